"""Demo and test data generators, kept out of the library's code paths.

- :mod:`anchorctx.demo.corpus`: the seeded synthetic corpus in the SlimPajama layout and its
  byte-level BPE tokenizer (``data.demo_corpus``; ``anchorctx demo-corpus``).
- :mod:`anchorctx.demo.fixtures`: evaluation inputs in the real file formats
  (``evaluation.demo_fixtures``) and the small RULER-only set the RULER tests use.
- :mod:`anchorctx.demo.synthetic`: synthetic packed rows for the training benchmarks.
- :mod:`anchorctx.demo.paper_assets`: stand-ins in the published formats for every input the
  paper configs name (``anchorctx demo-assets --paper DIR``, :mod:`anchorctx.demo.commands`).

Nothing in the library imports this package: the commands and Prefect tasks that need demo data
write it with one explicit call (:func:`ensure_demo_corpus`, :func:`ensure_eval_fixtures`)
before they run the library, so a cache key or a library function never writes files as a side
effect (the import rule is enforced by tests/test_architecture.py).
"""

from typing import TYPE_CHECKING

from anchorctx import lazy

if TYPE_CHECKING:
    from anchorctx.demo.corpus import DemoCorpus, ensure_demo_corpus, write_demo_corpus
    from anchorctx.demo.fixtures import ensure_eval_fixtures, write_eval_fixtures

# public name -> the module that defines it; loaded on first use, so ``anchorctx --help``
# (which lists ``demo-assets`` from :mod:`anchorctx.demo.commands`) loads no generator.
_EXPORTS = {
    "DemoCorpus": "anchorctx.demo.corpus",
    "ensure_demo_corpus": "anchorctx.demo.corpus",
    "write_demo_corpus": "anchorctx.demo.corpus",
    "ensure_eval_fixtures": "anchorctx.demo.fixtures",
    "write_eval_fixtures": "anchorctx.demo.fixtures",
}

__all__ = [
    "DemoCorpus",
    "ensure_demo_corpus",
    "ensure_eval_fixtures",
    "write_demo_corpus",
    "write_eval_fixtures",
]

__getattr__, __dir__ = lazy.exports(__name__, _EXPORTS)
