"""lm-eval model ``anchorctx``: a checkpoint scored and decoded the project's way.

``lm_eval`` with ``--model anchorctx`` evaluates a Hugging Face checkpoint directory with

- ``generate_until``: greedy decoding through :func:`anchorctx.evaluation.generation.
  generate_greedy` (the static-cache decoder, :mod:`anchorctx.models.decoding`, where the model
  supports it: ``engine=auto``; ``static`` or ``hf`` force one), stopping at EOS and at the
  request's ``until`` strings, at most ``max_gen_toks`` new tokens (lm-eval's default 256);
- ``loglikelihood`` and ``loglikelihood_rolling``: the model's own forward (for the static
  decoder's model types its base model, then its output embedding on the scored positions only;
  for any other causal LM the model's logits, as lm-eval's ``hf`` model computes them), logits
  log-softmaxed in ``softmax_dtype``: float32 by default; ``None`` keeps the logits' dtype, as
  lm-eval's ``hf`` model does by default (bfloat16 log-probabilities for a bfloat16 model, where
  two choices of a question can round to the same value).

The anchor rule (docs/ARCHITECTURE.md; :func:`anchorctx.models.loading.anchor_token_id`): every
sequence the model sees starts with exactly one anchor token, the tokenizer's BOS (its EOS where
it has no BOS, as Qwen's), as in training, RULER and LongBench. Text is encoded without special
tokens and the anchor is put in front unless the text already starts with it (a chat template
that writes BOS). For a BOS tokenizer this is what lm-eval's ``hf`` model produces for
generation and loglikelihood contexts, so the two agree request for request
(tests/test_lm_eval_model.py); the differences are deliberate:

- ``loglikelihood_rolling``: lm-eval's ``hf`` model feeds its prefix token *and* the tokenizer's
  BOS (two anchors, the second one scored) unless it is given ``add_bos_token=False``; here the
  text is scored once, after one anchor, which is what ``hf`` computes with
  ``add_bos_token=False``.
- Truncation (``keep_anchor=True``, the default): a context longer than the budget loses tokens
  from the left, as in lm-eval, but the anchor stays at position 0 (``[anchor] + last tokens``),
  and every rolling window after the first starts with the anchor too (windows of
  ``max_length - 1`` tokens after it). ``keep_anchor=False`` truncates and windows exactly as
  lm-eval's ``hf`` model does, anchor dropped.
- Tokenizers without BOS get their EOS anchor; lm-eval's ``hf`` model gives them none.

Batches are length-bucketed: requests sorted longest first, cut into ``batch_size`` rows,
results put back in request order. Scoring requests whose model inputs are identical (the
choices of a multiple-choice question with one-token answers) share one forward pass.

Model arguments (``--model_args key=value,...``): ``pretrained`` (checkpoint directory with its
tokenizer; or a loaded model, then ``tokenizer`` too), ``dtype`` (bfloat16, float16, float32 or
auto = the checkpoint's), ``device`` (auto, cpu, cuda, cuda:N; lm-eval's CLI passes ``--device``,
default cuda:0, which falls back to the CPU where no GPU is visible, as lm-eval's ``hf`` model
does), ``batch_size`` (lm-eval's ``--batch_size``), ``max_length`` (default: the model's
``max_position_embeddings``, as lm-eval resolves it), ``max_gen_toks``, ``engine``,
``deterministic`` (the static engine's run-to-run deterministic decode kernel),
``keep_anchor``, ``softmax_dtype`` (float32, bfloat16, float16 or None), ``config`` (an
experiment config file: its ``model.rope_scaling`` and ``model.max_position_embeddings`` apply to
a checkpoint outside its run, as ``anchorctx evaluate --checkpoint`` applies them, e.g. Table 2's
Free* YaRN row; a run's own checkpoints keep the RoPE their training saved).

MMLU and HellaSwag (:mod:`~anchorctx.evaluation.lm_eval.harness`) score with this model as
lm-eval's ``hf`` model does (``keep_anchor=False``, ``softmax_dtype=None``), the long-context
suites (:mod:`~anchorctx.evaluation.lm_eval.suites`) with ``evaluation.lm_eval``'s settings.

Command line: lm-eval 0.4.13 finds models only in its own registry (no entry-point group, no
plugin import; ``--include_path`` adds task YAMLs only), so the model must be registered in the
process that runs lm-eval's CLI. This module does it and then runs that CLI::

    python -m anchorctx.evaluation.lm_eval.model --model anchorctx \\
        --model_args pretrained=DIR,dtype=bfloat16 --device cuda --batch_size 8 --tasks ...

Every other argument is lm-eval's own. In Python, importing this module registers the model:
``simple_evaluate(model="anchorctx", model_args={...})`` then finds it.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

# lm-eval registers its own models (``hf``, ...) when ``lm_eval.models`` is imported, and
# ``get_model`` imports it only while the registry is empty: registering ``anchorctx`` into an
# empty registry would hide them for the rest of the process.
import lm_eval.models  # noqa: F401
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
    resolve_max_length,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

from anchorctx.evaluation.generation import ENGINES, generate_greedy, load_eval_model
from anchorctx.evaluation.lm_eval.call import MODEL_NAME, quiet
from anchorctx.evaluation.model_overrides import eval_model_overrides
from anchorctx.experiment import load_config
from anchorctx.models.decoder import SUPPORTED_MODEL_TYPES
from anchorctx.models.decoding import StopRules
from anchorctx.models.loading import DTYPES, anchor_token_id, read_model_config, resolve_device

# lm-eval's default when neither the config nor the tokenizer give a length (``hf`` model's too).
DEFAULT_MAX_LENGTH = 2048
# lm-eval's default number of new tokens when a request does not say (``hf`` model's too).
DEFAULT_MAX_GEN_TOKS = 256
# Float32 logits of at most this many elements at once (256 MiB): the output embedding runs on
# chunks of scored positions, so a 32K-token rolling window never holds [32K, vocab] logits.
HEAD_CHUNK_ELEMENTS = 1 << 26
# Model types whose logits are their output embedding of the base model's last hidden states (no
# soft-capping or scaling after it): the static decoder's. Any other causal LM is scored on its
# full logits.
HEAD_ON_HIDDEN = SUPPORTED_MODEL_TYPES

logger = logging.getLogger(__name__)


def _resolve_dtype(dtype: str, checkpoint: Path) -> str:
    """``auto``: the dtype the checkpoint was saved in (float32 when it names none we load)."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}: expected auto or one of {', '.join(DTYPES)}")
        return dtype
    saved = read_model_config(checkpoint)
    name = str(saved.get("dtype") or saved.get("torch_dtype") or "float32")
    return name.removeprefix("torch.") if name.removeprefix("torch.") in DTYPES else "float32"


def _resolve_device(device: str | None) -> str:
    """lm-eval's CLI passes ``--device`` (default cuda:0) to every model: like lm-eval's ``hf``
    model, a CUDA device on a machine without one falls back to the CPU (with a warning)."""
    if device is not None and device.startswith("cuda") and not torch.cuda.is_available():
        logger.warning("device=%s but no CUDA GPU is visible: running on the CPU", device)
        return "cpu"
    return resolve_device(device, "model_args device")


def _softmax_dtype(value: str | None) -> torch.dtype | None:
    if value is None:
        return None
    if value not in DTYPES:
        raise ValueError(f"softmax_dtype={value!r}: expected None or one of {', '.join(DTYPES)}")
    return getattr(torch, DTYPES[value])


def _batch_size(value: int | str) -> int:
    if isinstance(value, str) and not value.strip().isdigit():
        raise ValueError(
            f"batch_size={value!r}: the anchorctx model takes a number of rows (batches are "
            "length-bucketed; there is no automatic batch size)"
        )
    size = int(value)
    if size < 1:
        raise ValueError(f"batch_size={size}: expected at least 1")
    return size


def _model_overrides(config: str | Path | None, checkpoint: Path) -> dict[str, Any] | None:
    """The ``model.*`` settings of the experiment config ``config`` that evaluation applies to
    ``checkpoint`` (a base model outside the run with ``model.rope_scaling`` other than keep:
    Table 2's Free* rows), by the one rule the suites follow
    (:func:`~anchorctx.evaluation.model_overrides.eval_model_overrides`)."""
    if config is None:
        return None
    return eval_model_overrides(load_config(config), checkpoint) or None


@register_model(MODEL_NAME)
class AnchorctxLM(TemplateLM):
    """lm-eval's ``LM`` over a checkpoint, with the project's anchor rule and decoder (see the
    module docstring for the arguments and how it differs from lm-eval's ``hf`` model)."""

    def __init__(
        self,
        pretrained: str | Path | Any,
        *,
        tokenizer: Any = None,
        dtype: str = "bfloat16",
        device: str | None = "auto",
        batch_size: int | str = 1,
        max_length: int | None = None,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        engine: str = "auto",
        deterministic: bool = False,
        keep_anchor: bool = True,
        softmax_dtype: str | None = "float32",
        max_batch_size: int | None = None,  # lm-eval's auto batch size; not used here
        config: str | Path | None = None,
    ) -> None:
        super().__init__()
        if engine not in ENGINES:
            raise ValueError(f"engine={engine!r}: expected one of {', '.join(ENGINES)}")
        self.softmax_dtype = softmax_dtype
        self._softmax_torch_dtype = _softmax_dtype(softmax_dtype)  # checked before any load
        if isinstance(pretrained, str | Path):
            if tokenizer is not None:
                raise ValueError("tokenizer: the checkpoint directory's own tokenizer is used")
            path = Path(pretrained)
            model, tokenizer = load_eval_model(
                path,
                device=_resolve_device(device),
                dtype=_resolve_dtype(dtype, path) if (path / "config.json").is_file() else dtype,
                model_overrides=_model_overrides(config, path),
            )
            self.pretrained = str(path)
        else:  # an already-loaded model (a caller that holds one; no second copy is loaded)
            if tokenizer is None:
                raise ValueError("a loaded model as pretrained needs its tokenizer")
            if config is not None:
                raise ValueError("config: applies to a checkpoint directory (pretrained=DIR)")
            model = pretrained.eval()
            self.pretrained = str(getattr(model, "name_or_path", "") or type(model).__name__)
        self.model = model
        self.tokenizer = tokenizer
        self.anchor_id = anchor_token_id(tokenizer)
        # torch's Module.__getattr__ types .weight as Tensor | Module.
        self._device: torch.device = model.get_input_embeddings().weight.device  # type: ignore[assignment]
        self._batch_size = _batch_size(batch_size)
        self._max_length = int(max_length) if max_length else None
        self._max_gen_toks = int(max_gen_toks)
        self.engine = engine
        self.deterministic = bool(deterministic)
        self.keep_anchor = bool(keep_anchor)
        self._head_on_hidden = model.config.model_type in HEAD_ON_HIDDEN
        if self.max_length < 2:
            raise ValueError(f"max_length={self.max_length}: expected at least 2 tokens")

    # -- lm-eval's model interface --------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is (lm-eval's ``TemplateLM.loglikelihood``): the anchor."""
        return self.anchor_id

    @property
    def max_length(self) -> int:
        if self._max_length:
            return self._max_length
        return resolve_max_length(self.model.config, self.tokenizer, default=DEFAULT_MAX_LENGTH)

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def tok_encode(
        self,
        string: str,
        add_special_tokens: bool | None = None,
        left_truncate_len: int | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of ``string`` with exactly one anchor in front; none only when
        ``add_special_tokens=False`` (lm-eval's continuation-only encoding)."""
        ids = self.tokenizer.encode(string, add_special_tokens=False)
        if add_special_tokens is not False and (not ids or ids[0] != self.anchor_id):
            ids = [self.anchor_id, *ids]
        return self._fit(ids, left_truncate_len) if left_truncate_len else ids

    def tok_decode(self, tokens: int | Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval records about the model in its results' ``config``."""
        return {
            "model_dtype": str(self.model.dtype),
            "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
            "anchorctx": {
                "pretrained": self.pretrained,
                "anchor_token_id": self.anchor_id,
                "keep_anchor": self.keep_anchor,
                "softmax_dtype": self.softmax_dtype,
                "engine": self.engine,
                "deterministic": self.deterministic,
                "max_length": self.max_length,
            },
        }

    # -- truncation ---------------------------------------------------------------------------
    def _fit(self, ids: list[int], budget: int) -> list[int]:
        """``ids`` (anchor first) cut from the left to ``budget`` tokens, the anchor kept at
        position 0 with ``keep_anchor``."""
        if len(ids) <= budget:
            return ids
        if self.keep_anchor:
            return [self.anchor_id, *ids[len(ids) - budget + 1 :]] if budget > 1 else ids[:1]
        return ids[-budget:]

    def _scored_input(self, context: list[int], continuation: list[int]) -> list[int]:
        """The model input that scores ``continuation`` after ``context``: both joined, the last
        token dropped, cut from the left to ``max_length`` when longer."""
        whole = [*context, *continuation]
        limit = self.max_length
        if len(whole) - 1 <= limit:
            return whole[:-1]
        room = limit - 1 if self.keep_anchor else limit
        if len(continuation) > room:
            raise ValueError(
                f"a continuation of {len(continuation)} tokens does not fit max_length {limit}"
                + (" after the anchor" if self.keep_anchor else "")
            )
        logger.warning(
            "context and continuation (%d tokens) exceed max_length %d: the context is cut "
            "from the left%s",
            len(whole),
            limit,
            " (anchor kept)" if self.keep_anchor else "",
        )
        return self._fit(whole, limit + 1)[:-1]

    # -- scoring --------------------------------------------------------------------------------
    def _forward(self, rows: list[tuple[int, ...]]) -> torch.Tensor:
        """[B, T, X] for ``rows``, right-padded to the longest (causal attention: padding after
        a row's tokens cannot change them): the base model's last hidden states (X = hidden)
        for :data:`HEAD_ON_HIDDEN` model types, else the model's logits (X = vocabulary)."""
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id
        ids = torch.full((len(rows), width), self.anchor_id if pad is None else pad)  # [B, T]
        for b, row in enumerate(rows):
            ids[b, : len(row)] = torch.tensor(row)
        if not self._head_on_hidden:
            return self.model(input_ids=ids.to(self.device), use_cache=False).logits
        base = self.model.get_decoder()
        return base(input_ids=ids.to(self.device), use_cache=False).last_hidden_state

    def _logprobs(self, states: torch.Tensor) -> torch.Tensor:
        """Log-probabilities [n, V] in ``softmax_dtype`` from :meth:`_forward`'s [n, X]."""
        logits = self.model.get_output_embeddings()(states) if self._head_on_hidden else states
        return torch.log_softmax(logits, dim=-1, dtype=self._softmax_torch_dtype)

    def _score_row(
        self, states: torch.Tensor, length: int, continuations: list[list[int]]
    ) -> list[tuple[float, bool]]:
        """(log-probability, greedy?) of each continuation predicted at the last positions of
        one row (``states`` [T, X] from :meth:`_forward`, ``length`` real tokens). A
        continuation's log-probabilities are summed in ``softmax_dtype``, as lm-eval's ``hf``
        model sums them (a bfloat16 sum with ``None`` on a bfloat16 model)."""
        span = max(len(c) for c in continuations)
        chunk = max(1, HEAD_CHUNK_ELEMENTS // self.model.config.vocab_size)
        picked: list[list[torch.Tensor]] = [[] for _ in continuations]
        greedy = [True] * len(continuations)
        for lo in range(length - span, length, chunk):
            hi = min(length, lo + chunk)
            logprobs = self._logprobs(states[lo:hi])  # [hi - lo, V]
            best = logprobs.argmax(dim=-1)  # [hi - lo]
            for k, cont in enumerate(continuations):
                first = length - len(cont)  # the position that predicts cont[0]
                start = max(lo, first)
                if start >= hi:
                    continue
                target = torch.tensor(cont[start - first : hi - first], device=states.device)
                picked[k].append(logprobs[start - lo : hi - lo].gather(1, target[:, None]))
                greedy[k] &= bool((best[start - lo : hi - lo] == target).all())
        return [(float(torch.cat(p).sum()), g) for p, g in zip(picked, greedy)]

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
        disable_tqdm: bool = False,
        **kwargs: Any,
    ) -> list[tuple[float, bool]]:
        """(log-probability, greedy?) per (request strings, context ids, continuation ids)."""
        rows: dict[tuple[int, ...], list[int]] = {}  # model input -> requests it scores
        for i, (_, context, continuation) in enumerate(requests):
            if not context or not continuation:
                raise ValueError("loglikelihood needs context and continuation tokens")
            rows.setdefault(tuple(self._scored_input(context, continuation)), []).append(i)
        order = sorted(rows, key=len, reverse=True)  # longest first: a batch pads to its first
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc="anchorctx loglikelihood", disable=disable_tqdm)
        with torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                batch = order[start : start + self.batch_size]
                states = self._forward(batch)  # [B, T, hidden or vocabulary]
                for b, row in enumerate(batch):
                    members = rows[row]
                    conts = [list(requests[i][2]) for i in members]
                    for i, answer in zip(members, self._score_row(states[b], len(row), conts)):
                        out[i] = answer
                        if requests[i][0] is not None:
                            self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
                    bar.update(len(members))
        bar.close()
        return out  # type: ignore[return-value]

    def rolling_windows(self, tokens: list[int]) -> list[tuple[list[int], list[int]]]:
        """(context, continuation) windows that predict every token of ``tokens`` (text, no
        anchor) once, after the anchor: lm-eval's rolling windows, disjoint; with
        ``keep_anchor`` each later window's context starts with the anchor as well (windows of
        ``max_length - 1`` tokens after it)."""
        size = self.max_length - 1 if self.keep_anchor else self.max_length
        windows = [
            make_disjoint_window(pair)
            for pair in get_rolling_token_windows(
                token_list=tokens, prefix_token=self.anchor_id, max_seq_len=size, context_len=1
            )
        ]
        if self.keep_anchor:
            windows = [
                (c if k == 0 else [self.anchor_id, *c], p) for k, (c, p) in enumerate(windows)
            ]
        return windows

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        windows: list[tuple[tuple[str, str] | None, list[int], list[int]]] = []
        owner: list[int] = []
        for i, req in enumerate(requests):
            (text,) = req.args
            for context, continuation in self.rolling_windows(
                self.tok_encode(text, add_special_tokens=False)
            ):
                windows.append((None, context, continuation))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -- generation -----------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = {}  # requests with the same generation kwargs
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        out: list[str] = [""] * len(requests)
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        for members in groups.values():
            gen_kwargs = requests[members[0]].args[1]
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            if kwargs.get("do_sample"):
                raise ValueError(f"the anchorctx model decodes greedily; got {gen_kwargs}")
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            new_tokens = int(kwargs.pop("max_gen_toks"))
            budget = self.max_length - new_tokens
            if budget < 1:
                raise ValueError(
                    f"max_gen_toks {new_tokens} leaves no room for a prompt in max_length "
                    f"{self.max_length}"
                )
            contexts = [requests[i].args[0] for i in members]
            full = [self.tok_encode(c) for c in contexts]
            encoded = [self._fit(ids, budget) for ids in full]
            cut = sum(len(e) < len(f) for e, f in zip(encoded, full))
            if cut:
                logger.warning(
                    "%d prompts longer than %d tokens (max_length %d - max_gen_toks %d) cut "
                    "from the left%s",
                    cut,
                    budget,
                    self.max_length,
                    new_tokens,
                    " (anchor kept)" if self.keep_anchor else "",
                )
            texts = generate_greedy(
                self.model,
                self.tokenizer,
                contexts,
                max_new_tokens=new_tokens,
                batch_size=self.batch_size,
                progress=not disable_tqdm,
                desc="anchorctx generate_until",
                engine=self.engine,
                stop=StopRules(stop_strings=tuple(s for s in until if s)),
                deterministic=self.deterministic,
                encoded=encoded,
            )
            for i, text in zip(members, texts):
                out[i] = postprocess_generated_text(text, until, think_end_token=None)
                self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
        return out


def make_lm(model: Any, tokenizer: Any, **options: Any) -> AnchorctxLM:
    """The one way the suites build their lm-eval model: :class:`AnchorctxLM` around the already
    loaded checkpoint (no second copy is loaded), ``options`` its keyword arguments, lm-eval's
    logs quieted (:func:`~.call.quiet`)."""
    quiet()
    return AnchorctxLM(model, tokenizer=tokenizer, **options)


def main(argv: Iterable[str] | None = None) -> None:
    """lm-eval's command line, with the ``anchorctx`` model registered (importing this module
    did it)."""
    # Imported here: lm-eval's CLI module is needed only on the command line.
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
