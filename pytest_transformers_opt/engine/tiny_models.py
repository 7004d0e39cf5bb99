"""Built-in offline models: real Transformers architectures built from configs, saved and loaded from disk.

Nothing is downloaded. A model is built once per machine into a cache folder (atomically, so that
parallel workers never see half a folder) and then loaded with ``from_pretrained`` as users load
theirs. The tokenizer is a real byte-level BPE trained offline with ``tokenizers``.

Why the tiny models are briefly trained: a purely random model has near-uniform next-token
distributions, so any perturbation (8-bit weights, a quantized cache) flips greedy tokens and
similarity verdicts mean nothing. A few hundred steps on a synthetic corpus give peaked
distributions like a real LM's, so "lossless" and "lossy" techniques are judged as on real models.

The trained models ship with the package (``builtin_models/``, made by ``scripts/build_builtin_models.py``
with :func:`build_tiny_model`): a first use unpacks them into the cache in well under a second. A spec
that the shipped files were not made for (another fingerprint) is trained here as before. The untrained
``small-random-llama-100m`` is not shipped (350 MB): it is initialised, seeded, on first use.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from ..errors import OptConfigError
from ..units import format_duration
from .progress import Work, estimate, long_work, projected_left, say

# 2: untrained models are initialised on the meta device, once (other values than version 1's)
FACTORY_VERSION = 2
CACHE_ENV = "PYTEST_TRANSFORMERS_OPT_CACHE"
WEIGHTS_FILE = "model.safetensors"
DONE_FILE = "tiny_model.json"  # written last: marks a complete folder

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]


@dataclass(frozen=True)
class TinyModelSpec:
    """How to build one built-in model: its architecture, shape and training budget."""

    name: str
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int = 512
    max_position_embeddings: int = 1024
    train_steps: int = 300
    extra: dict[str, Any] = field(default_factory=dict)
    description: str = ""


TINY_MODELS: dict[str, TinyModelSpec] = {
    spec.name: spec
    for spec in (
        TinyModelSpec("tiny-random-llama", "llama", 128, 2, 4, 2, 256,
                      description="Llama shape, head dim 32, ~0.5M parameters, fp32; the default model"),
        TinyModelSpec("tiny-random-qwen3", "qwen3", 128, 2, 4, 2, 256, extra={"head_dim": 32},
                      description="Qwen3 shape (q/k norms, explicit head_dim)"),
        TinyModelSpec("tiny-random-mistral", "mistral", 128, 2, 4, 2, 256, extra={"sliding_window": 16},
                      description="Mistral shape with a 16-token sliding window"),
        TinyModelSpec("tiny-random-gpt2", "gpt2", 128, 2, 4, 4, 256,
                      description="GPT-2 shape (learned positions, no GQA)"),
        # the architectures the matrix adds (issue 22): what a cache, a compiled graph or a quantizer meets
        TinyModelSpec("tiny-random-gemma3", "gemma3_text", 128, 2, 4, 2, 256,
                      extra={"head_dim": 32, "sliding_window": 16,
                             "layer_types": ["sliding_attention", "full_attention"]},
                      description="Gemma 3 shape: a 16-token sliding layer and a global layer, q/k norms"),
        TinyModelSpec("tiny-random-gpt-oss", "gpt_oss", 128, 2, 4, 2, 128,
                      extra={"head_dim": 32, "sliding_window": 16,
                             "layer_types": ["sliding_attention", "full_attention"],
                             "num_local_experts": 4, "num_experts_per_tok": 2,
                             # GPT-OSS's YaRN scaling, shrunk so that 32 x 32 = the 1024 positions above
                             "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                 "original_max_position_embeddings": 32}},
                      description="GPT-OSS shape: sliding and global layers, attention sinks, 4 experts (top-2)"),
        TinyModelSpec("tiny-random-qwen3-moe", "qwen3_moe", 128, 2, 4, 2, 256,
                      extra={"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
                             "moe_intermediate_size": 64, "decoder_sparse_step": 1},
                      description="Qwen3-MoE shape: 4 experts (top-2) in every layer, q/k norms"),
        TinyModelSpec("tiny-random-phi3", "phi3", 128, 2, 4, 2, 256,
                      description="Phi-3 shape (fused qkv and gate/up projections)"),
        TinyModelSpec("small-random-llama-100m", "llama", 768, 12, 12, 4, 2048, vocab_size=8192,
                      train_steps=0, description="Llama shape, ~100M parameters, untrained; for memory checks"),
    )
}


def is_tiny_model(name_or_path: str) -> bool:
    """True for a built-in model name (as opposed to a folder or a hub id)."""
    return name_or_path in TINY_MODELS


def cache_root() -> Path:
    """Where built models live: ``$PYTEST_TRANSFORMERS_OPT_CACHE`` or ``~/.cache/pytest-transformers-opt``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "pytest-transformers-opt"


def _spec_for(name: str) -> TinyModelSpec:
    try:
        return TINY_MODELS[name]
    except KeyError:
        raise OptConfigError(
            f"unknown built-in model {name!r}; built-in models: {', '.join(sorted(TINY_MODELS))}"
        ) from None


def _fingerprint(spec: TinyModelSpec) -> str:
    blob = json.dumps({"v": FACTORY_VERSION, **asdict(spec)}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def tiny_model_config(name: str) -> Any:
    """The ``transformers`` config of a built-in model, without building weights (for the advisor)."""
    spec = _spec_for(name)
    return _make_config(spec, vocab_size=spec.vocab_size)


def _make_config(spec: TinyModelSpec, vocab_size: int) -> Any:
    from transformers import AutoConfig

    common: dict[str, Any] = dict(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=3,
                                  tie_word_embeddings=False)
    if spec.model_type == "gpt2":
        return AutoConfig.for_model(
            "gpt2", n_embd=spec.hidden_size, n_layer=spec.num_hidden_layers, n_head=spec.num_attention_heads,
            n_inner=spec.intermediate_size, n_positions=spec.max_position_embeddings, **common, **spec.extra,
        )
    return AutoConfig.for_model(
        spec.model_type,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
        **common,
        **spec.extra,
    )


def synthetic_corpus(seed: int = 0, sentences: int = 2000) -> list[str]:
    """A small, deterministic English-like corpus (grammar templates) for tokenizer and model training."""
    rng = random.Random(seed)
    subjects = ["The cat", "A dog", "The model", "My friend", "The teacher", "A small bird", "The engineer",
                "Our team", "The river", "The sun"]
    verbs = ["eats", "sees", "builds", "likes", "finds", "moves", "explains", "carries", "follows", "paints"]
    objects = ["the red apple", "a long story", "the big house", "a quiet song", "the old bridge",
               "a bright idea", "the green field", "a heavy box", "the cold water", "a simple rule"]
    tails = ["every morning.", "in the park.", "with great care.", "before the night.", "near the sea.",
             "after the rain.", "for the city.", "under the tree."]
    corpus = [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} {rng.choice(tails)}"
              for _ in range(sentences)]
    corpus += [
        "Explain gravity in one sentence. Gravity pulls every mass toward every other mass.",
        "Name the capital of France. The capital of France is Paris.",
        "Write a short poem about the sea. The sea is wide and the sea is deep.",
    ] * 50
    return corpus


def train_tokenizer(corpus: list[str], vocab_size: int) -> Any:
    """A byte-level BPE tokenizer trained on ``corpus`` (at most 512 tokens), as a ``PreTrainedTokenizerFast``
    with the built-in models' special tokens; left padding, for batched generation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, 512), special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>", padding_side="left")


def _train_briefly(model: Any, tokenizer: Any, corpus: list[str], steps: int, seed: int,
                   on_step: Callable[[int, float], None] | None = None) -> None:
    import time

    import torch

    ids = torch.tensor([t for text in corpus for t in tokenizer.encode(text) + [tokenizer.eos_token_id]])
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        starts = torch.randint(0, len(ids) - 65, (16,), generator=generator)
        batch = torch.stack([ids[s : s + 64] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if on_step is not None:
            on_step(step + 1, time.perf_counter() - start)
    model.eval()


def build_tiny_model(name: str, directory: str | os.PathLike[str], seed: int = 0,
                     on_step: Callable[[int, float], None] | None = None) -> Path:
    """Build the named model into ``directory`` with ``save_pretrained`` (safetensors).

    ``on_step(step, seconds_so_far)`` is called after each training step (progress lines)."""
    import torch
    from transformers import AutoModelForCausalLM

    spec = _spec_for(name)
    corpus = synthetic_corpus(seed)
    tokenizer = train_tokenizer(corpus, spec.vocab_size)
    vocab = max(spec.vocab_size, len(tokenizer)) if spec.train_steps == 0 else len(tokenizer)
    config = _make_config(spec, vocab_size=vocab)
    torch.manual_seed(seed)
    with torch.random.fork_rng():
        if spec.train_steps:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            _train_briefly(model, tokenizer, corpus, spec.train_steps, seed, on_step)
        else:
            model = _initialised_once(config)
    out = Path(directory)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / DONE_FILE).write_text(json.dumps({"name": name, "factory_version": FACTORY_VERSION,
                                             "fingerprint": _fingerprint(spec)}))
    return out


def _initialised_once(config: Any) -> Any:
    """An untrained model with transformers' own initialisation (global RNG, seeded by the caller).

    Built on the meta device and initialised once, where ``from_config`` on the CPU initialises every
    weight twice (PyTorch's default, then the model's): 1 s for the 100M model on a busy 2-core machine,
    whose first use then takes about 9 s, most of it writing 350 MB. Non-persistent buffers (rotary
    tables) are left as they come: only the saved weights are used, and a load recomputes them."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to_empty(device="cpu")
    model.init_weights()
    return model.eval()


# -- the shipped models ---------------------------------------------------------------------------------
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "builtin_models"  # package data
SHIPPED_MANIFEST = "manifest.json"
# float16: half of float32's bytes, with 3 more mantissa bits than bfloat16 (the trained weights are far
# from float16's range limits); unpacking upcasts them to float32, the dtype a built model has
SHIPPED_DTYPE = "float16"
SHIPPED_MODEL_FILES = ("config.json", "generation_config.json")
SHIPPED_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # stored once: every model's is the same
UNPACK_ANNOUNCE_AFTER_S = 5.0  # unpacking takes well under a second; a slower one gets the progress lines


def shipped_manifest(root: Path = SHIPPED_DIR) -> dict[str, Any]:
    """What ``scripts/build_builtin_models.py`` wrote: the factory version, the weights' dtype and, under
    ``models``, each shipped model's spec fingerprint and weights' sha256. Empty without shipped data."""
    try:
        data = json.loads((root / SHIPPED_MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def spec_fingerprint(name: str) -> str:
    """The fingerprint of a built-in model's current spec (and factory version): its cache folder's suffix,
    and what a shipped model must have been made for."""
    return _fingerprint(_spec_for(name))


def shipped_entry(name: str, root: Path = SHIPPED_DIR) -> dict[str, Any] | None:
    """The manifest entry of ``name``'s shipped files when they were made for its current spec, else None
    (it is then built here: a spec changed since, e.g. a test that patches ``train_steps``)."""
    models = shipped_manifest(root).get("models")
    entry = models.get(name) if isinstance(models, dict) else None
    if (isinstance(entry, dict) and entry.get("fingerprint") == spec_fingerprint(name)
            and (root / name / WEIGHTS_FILE).is_file()):
        return entry
    return None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def pack_tiny_model(built: Path, root: Path, *, replace_tokenizer: bool = False) -> dict[str, Any]:
    """Store a model that :func:`build_tiny_model` built into ``built`` under ``root`` as shipped: its
    weights in ``SHIPPED_DTYPE``, its config files, and the tokenizer once for every model (a ValueError
    when it differs from the one there, unless ``replace_tokenizer``). Returns its manifest entry."""
    import torch
    from safetensors.torch import load_file, save_file

    record = json.loads((built / DONE_FILE).read_text(encoding="utf-8"))
    name, dtype = record["name"], getattr(torch, SHIPPED_DTYPE)
    packed: dict[str, Any] = {}
    for key, tensor in load_file(built / WEIGHTS_FILE).items():
        if tensor.is_floating_point():
            tensor = tensor.to(dtype)
            if not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"{name}: {key} does not fit in {SHIPPED_DTYPE}; store the models in bfloat16")
        packed[key] = tensor.contiguous()
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    save_file(packed, folder / WEIGHTS_FILE, metadata={"format": "pt"})
    for file in SHIPPED_MODEL_FILES:
        shutil.copyfile(built / file, folder / file)
    for file in SHIPPED_TOKENIZER_FILES:
        there = root / file
        if there.is_file() and there.read_bytes() != (built / file).read_bytes() and not replace_tokenizer:
            raise ValueError(f"{name}: its {file} differs from the shipped one, which the other models use; "
                             f"rebuild them all (scripts/build_builtin_models.py with no names)")
        shutil.copyfile(built / file, there)
    return {"fingerprint": record["fingerprint"], "weights_sha256": _sha256(folder / WEIGHTS_FILE)}


def build_environment() -> dict[str, str]:
    """What the trained bytes depend on beyond the spec: a rebuild reproduces the shipped files only with
    these (training is chaotic: another CPU's or torch's rounding gives another model; transformers writes
    its version into config.json)."""
    import tokenizers
    import torch
    import transformers

    return {"torch": str(torch.__version__), "transformers": str(transformers.__version__),
            "tokenizers": str(tokenizers.__version__), "cpu_capability": str(torch.backends.cpu.get_cpu_capability())}


def write_shipped_manifest(root: Path, models: dict[str, dict[str, Any]]) -> Path:
    """The manifest of the models shipped under ``root`` (entries from :func:`pack_tiny_model`)."""
    path = root / SHIPPED_MANIFEST
    path.write_text(json.dumps({"factory_version": FACTORY_VERSION, "dtype": SHIPPED_DTYPE,
                                "built_with": build_environment(), "models": dict(sorted(models.items()))},
                               indent=1) + "\n", encoding="utf-8")
    return path


def unpack_tiny_model(name: str, directory: str | os.PathLike[str], root: Path = SHIPPED_DIR) -> Path:
    """Assemble the shipped model ``name`` into ``directory`` as :func:`build_tiny_model` would have saved
    it: float32 safetensors, config and tokenizer files, the done file."""
    from safetensors.torch import load_file, save_file

    entry = shipped_entry(name, root)
    if entry is None:
        raise OptConfigError(f"no shipped weights for the current spec of built-in model {name!r} in {root}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(root / name / WEIGHTS_FILE)
    save_file({key: tensor.float() if tensor.is_floating_point() else tensor for key, tensor in tensors.items()},
              out / WEIGHTS_FILE, metadata={"format": "pt"})
    for file in SHIPPED_MODEL_FILES:
        shutil.copyfile(root / name / file, out / file)
    for file in SHIPPED_TOKENIZER_FILES:
        shutil.copyfile(root / file, out / file)
    (out / DONE_FILE).write_text(json.dumps({"name": name, "factory_version": FACTORY_VERSION,
                                             "fingerprint": entry["fingerprint"],
                                             "shipped_weights_sha256": entry["weights_sha256"]}))
    return out


# Measured on a 2-core CI machine with torch's default threads (tiny-random-llama: 42 s in all,
# the first steps the slowest); the start line's estimate scales the steps by the cores torch uses.
BUILD_OVERHEAD_S = 15.0
TRAIN_STEP_S_2_CORES = 0.1


def build_estimate_s(spec: TinyModelSpec) -> float:
    """A rough duration of building ``spec`` on this machine (tokenizer, training, saving)."""
    import torch

    per_step: float = TRAIN_STEP_S_2_CORES * 2 / max(1, min(torch.get_num_threads(), 8))
    return BUILD_OVERHEAD_S + spec.train_steps * per_step


def _build_detail(spec: TinyModelSpec, final: Path) -> str:
    # what the estimate assumes is said: on a busy machine the build took 918 s against "about 40 s"
    why = "" if spec.train_steps == 0 else (
        "; trained here: the package ships no weights for this spec (scripts/build_builtin_models.py makes them)")
    return (f"first use on this machine, {estimate(build_estimate_s(spec), 'an idle machine')}; cached in "
            f"{final.parent} for later runs, the {CACHE_ENV} variable moves it{why}")


def ensure_tiny_model(name: str) -> Path:
    """The folder of a built-in model, unpacked from the package or built on first use; safe across processes."""
    spec = _spec_for(name)
    entry = shipped_entry(name)
    if entry is not None:
        # named for the shipped weights too: every machine uses those, never an older build of the spec
        final = cache_root() / f"{name}-{_fingerprint(spec)}-{entry['weights_sha256'][:8]}"

        def unpack(staging: Path, work: Work) -> None:
            started = time.perf_counter()
            unpack_tiny_model(name, staging)
            if not work.announced:
                say(f"built-in model {name} unpacked into {final.parent} in "
                    f"{format_duration(time.perf_counter() - started)} (first use on this machine)")

        return build_once(final, DONE_FILE, f"unpacking built-in model {name}", f"cached in {final.parent}", unpack,
                          after_s=UNPACK_ANNOUNCE_AFTER_S)
    final = cache_root() / f"{name}-{_fingerprint(spec)}"

    def build(staging: Path, work: Work) -> None:
        def on_step(step: int, seconds: float) -> None:
            work.status = f"training step {step}/{spec.train_steps}, {projected_left(step, spec.train_steps, seconds)}"

        build_tiny_model(name, staging, on_step=on_step)

    return build_once(final, DONE_FILE, f"building built-in model {name}", _build_detail(spec, final), build)


@contextmanager
def _build_lock(final: Path) -> Iterator[None]:
    """One builder per cache folder at a time (pytest-xdist workers), where the OS has ``flock``;
    without it, concurrent builders each build and the last rename loses harmlessly."""
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    with open(final.parent / f".{final.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
        yield


def build_once(final: Path, done_file: str, what: str, detail: str, build: Callable[[Path, Work], None],
               after_s: float = 0.0) -> Path:
    """``final``, built by ``build(staging, work)`` on first use (its ``work.status`` feeds the progress
    lines, announced at once or, with ``after_s``, only if still running by then); ``done_file``, written
    by ``build``, marks a complete folder.

    Safe across processes: built in a staging folder next to ``final`` and renamed into place, so no
    process ever sees half a folder, and a process that waited for another's build uses its result.
    """
    if (final / done_file).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(final):
        if (final / done_file).is_file():  # built by the process we waited for
            return final
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
        try:
            with long_work(what, detail=detail, after_s=after_s) as work:
                build(staging, work)
            try:
                os.replace(staging, final)  # atomic on one filesystem; loses the race harmlessly
            except OSError:
                if not (final / done_file).is_file():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final
