"""A tiny GGUF checkpoint written from the built-in ``tiny-random-llama`` (test fixture).

Written with the ``gguf`` package the way llama.cpp's ``convert_hf_to_gguf.py`` writes a Llama:
llama.cpp's tensor names, q/k rows permuted to its rotary layout (transformers' GGUF loader undoes
it), float32 tensors and a byte-level BPE ("gpt2") tokenizer. Under 3 MB, read back in well under a
second, so the GGUF path is tested without the 98 MB real file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _permute(weight: Any, heads: int) -> Any:
    # convert_hf_to_gguf.py's LlamaModel.permute: HF's rotary halves -> llama.cpp's interleaved pairs
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(model_folder: str | Path, out: str | Path) -> Path:
    """``out`` (a ``.gguf`` file) holding the safetensors Llama in ``model_folder`` and its tokenizer."""
    import gguf
    from safetensors.numpy import load_file

    folder = Path(model_folder)
    config = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    specials = {added["content"] for added in tok.get("added_tokens", []) if added.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]

    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("tiny random llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    rope_theta = config.get("rope_theta") or config.get("rope_parameters", {}).get("rope_theta", 10000.0)
    writer.add_rope_freq_base(float(rope_theta))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_add_bos_token(False)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for hf_name, tensor in load_file(str(folder / "model.safetensors")).items():
        base, suffix = hf_name.rsplit(".", 1)
        name = names.get_name(base)
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        if hf_name.endswith("q_proj.weight"):
            tensor = _permute(tensor, heads)
        elif hf_name.endswith("k_proj.weight"):
            tensor = _permute(tensor, kv_heads)
        writer.add_tensor(f"{name}.{suffix}", tensor.astype("float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out)


def tiny_gguf_folder(folder: Path, copies: int = 1) -> Path:
    """A folder as a user downloads one: ``tiny.F32.gguf`` (the built-in tiny Llama's weights) and, with
    ``copies=2``, ``tiny-copy.F32.gguf`` holding the same; no config.json."""
    import shutil

    from pytest_transformers_opt.engine.tiny_models import ensure_tiny_model

    write_tiny_gguf(ensure_tiny_model("tiny-random-llama"), folder / "tiny.F32.gguf")
    if copies == 2:
        shutil.copy(folder / "tiny.F32.gguf", folder / "tiny-copy.F32.gguf")
    return folder
