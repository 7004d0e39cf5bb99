"""Weight quantization: bitsandbytes 8-bit and 4-bit, optimum-quanto, HQQ and torchao."""

from __future__ import annotations

import functools
from typing import Any, ClassVar

from ..compat import module_available
from ..errors import OptConfigError
from .base import (
    DOCS,
    LOSSY_4BIT,
    WEIGHTS_8BIT,
    LoadSettings,
    ProbeContext,
    Technique,
    version_ok,
)


class WeightQuantization(Technique):
    family = "quantization"
    exclusive_group = "weight quantization"
    load_time = True
    docs = f"{DOCS}/quantization/overview"
    docs_title = "Quantization"
    overview_section = "Quantization"
    layer_class_names: ClassVar[tuple[str, ...]] = ()

    def verify_loaded(self, model: Any) -> str | None:
        names = {type(m).__name__ for m in model.modules()}
        if not names & set(self.layer_class_names):
            return f"{self.label()} was requested but no {'/'.join(self.layer_class_names)} layer is in the model"
        return None


class _Bnb(WeightQuantization):
    requirement = "bitsandbytes >= 0.45 (0.50 has a CPU backend; older releases need CUDA)"
    docs = f"{DOCS}/quantization/bitsandbytes"
    docs_title = "Quantization > bitsandbytes"
    package = "bitsandbytes"

    def probe(self, ctx: ProbeContext) -> str | None:
        installed = ctx.hardware.version("bitsandbytes")
        if installed is None:
            return f"{self.name} needs the bitsandbytes package; found: not installed"
        if not ctx.hardware.is_cuda and not version_ok(installed, ">=0.48"):
            return f"{self.name} on cpu needs bitsandbytes >= 0.48 (CPU backend); found: bitsandbytes {installed}"
        return None


class Bnb8bit(_Bnb):
    name = "bnb_8bit"
    quality = WEIGHTS_8BIT
    summary = "LLM.int8() 8-bit weights through bitsandbytes"
    layer_class_names = ("Linear8bitLt",)

    def configure_load(self, load: LoadSettings, ctx: ProbeContext) -> None:
        from transformers import BitsAndBytesConfig

        load.kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)


class Bnb4bit(_Bnb):
    name = "bnb_4bit"
    quality = LOSSY_4BIT
    summary = "4-bit weights (nf4 or fp4) through bitsandbytes"
    layer_class_names = ("Linear4bit",)
    accepted_params = {"quant_type": "'nf4' or 'fp4'", "compute_dtype": "a torch dtype or its name",
                       "double_quant": "bool"}

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        if self.params.get("quant_type", "nf4") not in ("nf4", "fp4"):
            raise OptConfigError(f"bnb_4bit: quant_type={self.params['quant_type']!r}; accepted: 'nf4', 'fp4'")

    def configure_load(self, load: LoadSettings, ctx: ProbeContext) -> None:
        from transformers import BitsAndBytesConfig

        from ..units import parse_dtype

        compute = self.params.get("compute_dtype") or ctx.dtype
        load.kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=self.params.get("quant_type", "nf4"),
            bnb_4bit_compute_dtype=parse_dtype(compute, "bnb_4bit compute_dtype"),
            bnb_4bit_use_double_quant=bool(self.params.get("double_quant", False)),
        )


def projections_outside_linear(config: Any) -> list[str]:
    """The layer classes holding the 2-D weights of ``config``'s model when none of them (the output embeddings
    aside) is a ``torch.nn.Linear`` (e.g. ``["Conv1D"]`` for GPT-2); [] when some are Linear or the model cannot
    be built from its config. Built on the meta device: no memory, no weights, milliseconds."""
    try:
        return list(_projection_classes(config.to_json_string()))
    except Exception:  # not a transformers config, or no causal-LM class for it: nothing known, nothing refused
        return []


@functools.lru_cache(maxsize=16)
def _projection_classes(config_json: str) -> tuple[str, ...]:
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    data = json.loads(config_json)
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    skipped = (model.get_output_embeddings(), model.get_input_embeddings())
    holders = {type(module).__name__: isinstance(module, torch.nn.Linear) for module in model.modules()
               if module not in skipped and getattr(getattr(module, "weight", None), "ndim", 0) == 2
               and not isinstance(module, torch.nn.Embedding)}
    return () if any(holders.values()) else tuple(sorted(holders))


class _ModuleQuantization(WeightQuantization):
    package: ClassVar[str] = ""
    module: ClassVar[str] = ""

    def probe(self, ctx: ProbeContext) -> str | None:
        if not module_available(self.module):
            return f"{self.name} needs the {self.package} package; found: not installed"
        return None


class QuantoInt8(_ModuleQuantization):
    name = "quanto_int8"
    quality = WEIGHTS_8BIT
    summary = "int8 weights through optimum-quanto"
    package, module = "optimum-quanto", "optimum.quanto"
    layer_class_names = ("QLinear",)
    docs = f"{DOCS}/quantization/quanto"
    docs_title = "Quantization > Optimum Quanto"

    def probe(self, ctx: ProbeContext) -> str | None:
        missing = super().probe(ctx)
        if missing is not None or ctx.model_config is None:
            return missing
        # transformers' quanto integration swaps torch.nn.Linear only (lm_head excepted): GPT-2's Conv1D
        # projections stay as they are, a silent no-op the load's proof would fail
        others = projections_outside_linear(ctx.model_config)
        if others:
            arch = getattr(ctx.model_config, "model_type", "this model")
            return (f"quanto_int8 needs a model whose projections are torch.nn.Linear (optimum-quanto quantizes only "
                    f"those, lm_head excepted); found: {arch} with none, its projections are {', '.join(others)}")
        return None

    def configure_load(self, load: LoadSettings, ctx: ProbeContext) -> None:
        from transformers import QuantoConfig

        load.kwargs["quantization_config"] = QuantoConfig(weights="int8")


class HqqFourBit(_ModuleQuantization):
    name = "hqq_4bit"
    quality = LOSSY_4BIT
    summary = "4-bit weights through HQQ"
    package, module = "hqq", "hqq"
    layer_class_names = ("HQQLinear",)
    docs = f"{DOCS}/quantization/hqq"
    docs_title = "Quantization > HQQ"

    requirement = "the hqq package and a CUDA GPU (transformers' HQQ integration refuses a cpu device_map)"

    def probe(self, ctx: ProbeContext) -> str | None:
        missing = super().probe(ctx)
        if missing is None and not ctx.hardware.is_cuda:
            return (f"{self.name} needs a CUDA GPU (transformers' HQQ integration refuses a cpu or disk device_map); "
                    f"found: {ctx.hardware.describe()}")
        return missing

    def configure_load(self, load: LoadSettings, ctx: ProbeContext) -> None:
        from transformers import HqqConfig

        load.kwargs["quantization_config"] = HqqConfig(nbits=4, group_size=64)


class TorchaoInt8(_ModuleQuantization):
    name = "torchao_int8"
    quality = WEIGHTS_8BIT
    summary = "int8 weight-only quantization through torchao"
    package, module = "torchao", "torchao"
    docs = f"{DOCS}/quantization/torchao"
    docs_title = "Quantization > torchao"

    def configure_load(self, load: LoadSettings, ctx: ProbeContext) -> None:
        from torchao.quantization import Int8WeightOnlyConfig  # type: ignore[import-not-found, unused-ignore]  # torchao is optional: absent in most environments
        from transformers import TorchAoConfig

        load.kwargs["quantization_config"] = TorchAoConfig(quant_type=Int8WeightOnlyConfig())

    def verify_loaded(self, model: Any) -> str | None:
        quantized = [m for m in model.modules() if type(getattr(m, "weight", None)).__name__.endswith(("Tensor", "QuantizedTensor")) and type(m.weight).__name__ != "Parameter"]
        return None if quantized else "torchao_int8 was requested but no weight is a torchao quantized tensor"
