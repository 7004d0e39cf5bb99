"""Make the built-in tiny models' shipped files: ``pytest_transformers_opt/builtin_models/``.

One command regenerates them all, from the repository root, after any change to a tiny model's spec
(``TINY_MODELS`` in ``pytest_transformers_opt/engine/tiny_models.py``):

    python scripts/build_builtin_models.py

Change the corpus, the tokenizer or the training code and raise ``FACTORY_VERSION`` there first.
Each model with training steps is built exactly as a first use without shipped files builds it
(``build_tiny_model``: seed 0, its spec's AdamW steps), then stored by ``pack_tiny_model``: weights in
float16 (upcast to float32 when unpacked), its ``config.json`` and ``generation_config.json``, and the
tokenizer once for all of them; ``manifest.json`` records each model's spec fingerprint and weights'
sha256. It trains on one thread, so that every run gives the same bytes (measured: 38-72 s a model,
7.5 min for the eight, on a 2-core machine at load 8-11). Untrained models
(``small-random-llama-100m``) are not shipped: they are initialised, seeded, on first use.

``tests/integration/test_builtin_weights.py`` fails while a spec and its shipped files disagree, and
rebuilds one model to check that this script reproduces the shipped files.

    python scripts/build_builtin_models.py [NAME ...] [--out DIR] [--check]

NAME: only these models (the others' entries are kept; their tokenizer must be the shipped one).
``--out``: another folder than the package's. ``--check``: build into a temporary folder and say whether
each model's files are the shipped ones, byte for byte (exit 1 if not); nothing is written.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's package, installed or not

from pytest_transformers_opt.engine import tiny_models  # noqa: E402


def shipped_names() -> list[str]:
    """The built-in models that ship their weights: every trained one."""
    return [name for name, spec in tiny_models.TINY_MODELS.items() if spec.train_steps > 0]


def build_models(names: Sequence[str], out: Path, say: Callable[[str], None] = print) -> dict[str, dict[str, Any]]:
    """Train ``names`` and store them under ``out`` as shipped; the manifest keeps the entries of models
    not rebuilt that are still shipped. Building every shipped model replaces the tokenizer and drops
    folders of models no longer shipped."""
    import torch

    everything = set(names) == set(shipped_names())
    out.mkdir(parents=True, exist_ok=True)
    models = {name: entry for name, entry in tiny_models.shipped_manifest(out).get("models", {}).items()
              if name in shipped_names() and not everything}
    threads = torch.get_num_threads()
    # one thread: the MoE models' training gives other bytes with more (their experts' scatter-adds);
    # with one, every run gives the same bytes
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="builtin-models-") as scratch:
        for number, name in enumerate(names, 1):
            started = time.perf_counter()
            say(f"building {name} ({number}/{len(names)}) ...")
            built = tiny_models.build_tiny_model(name, Path(scratch) / name)
            models[name] = tiny_models.pack_tiny_model(built, out, replace_tokenizer=everything and number == 1)
            say(f"{name}: done in {time.perf_counter() - started:.1f} s, fingerprint {models[name]['fingerprint']}")
    torch.set_num_threads(threads)
    if everything:
        for folder in out.iterdir():
            if folder.is_dir() and folder.name not in models:
                shutil.rmtree(folder)
    tiny_models.write_shipped_manifest(out, models)
    return models


def differences(built: Path, shipped: Path, names: Sequence[str]) -> list[str]:
    """The files of ``names`` (and the tokenizer) that differ between two folders of shipped models."""
    files = [Path(name) / file for name in names
             for file in (tiny_models.WEIGHTS_FILE, *tiny_models.SHIPPED_MODEL_FILES)]
    files += [Path(file) for file in tiny_models.SHIPPED_TOKENIZER_FILES]
    return [str(file) for file in files
            if not (shipped / file).is_file() or (built / file).read_bytes() != (shipped / file).read_bytes()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"models to build (default: all of "
                        f"{', '.join(shipped_names())})")
    parser.add_argument("--out", type=Path, default=tiny_models.SHIPPED_DIR, help="default: %(default)s")
    parser.add_argument("--check", action="store_true", help="rebuild and compare with --out; write nothing")
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in shipped_names()]
    if unknown:
        parser.error(f"not a shipped built-in model: {', '.join(unknown)}; shipped: {', '.join(shipped_names())}")
    names = args.names or shipped_names()
    if not args.check:
        build_models(names, args.out)
        print(f"wrote {args.out}")
        return 0
    with tempfile.TemporaryDirectory(prefix="builtin-models-check-") as scratch:
        build_models(names, Path(scratch))
        differ = differences(Path(scratch), args.out, names)
    print("the shipped files are reproduced byte for byte" if not differ else f"differ: {', '.join(differ)}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
