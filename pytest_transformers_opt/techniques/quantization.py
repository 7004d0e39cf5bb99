"""Weight quantization: bitsandbytes 8-bit and 4-bit, optimum-quanto, HQQ and torchao."""

from __future__ import annotations

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
