"""torch.compile through transformers' static-cache compiled forward."""

from __future__ import annotations

from typing import Any

from .base import DOCS, GenerationSettings, ProbeContext, RunEvidence, Technique


class Compile(Technique):
    name = "compile"
    family = "compilation"
    summary = "a static cache and torch.compile of the forward pass, on every device"
    requirement = "a compileable cache (static); on CPU a C++ compiler for inductor"
    docs = f"{DOCS}/llm_optims#static-kv-cache-and-torchcompile"
    accepted_params = {"mode": "torch.compile mode, e.g. 'reduce-overhead'", "fullgraph": "bool",
                       "dynamic": "bool or None"}

    def probe(self, ctx: ProbeContext) -> str | None:
        if not ctx.hardware.is_cuda:
            import shutil

            if not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
                return "compile on cpu needs a C++ compiler for torch inductor; found: none on PATH"
        return None

    def configure_generation(self, gen: GenerationSettings, ctx: ProbeContext) -> None:
        from transformers import CompileConfig

        options = {k: v for k, v in self.params.items()}
        compile_config = CompileConfig(**options)
        # transformers compiles only on CUDA-like devices unless told; the plugin compiles everywhere.
        setattr(compile_config, "_compile_all_devices", True)  # transformers' own switch for this
        gen.kwargs["compile_config"] = compile_config
        gen.kwargs["disable_compile"] = False
        gen.kwargs.setdefault("cache_implementation", "static")
        gen.compile = True

    def verify_run(self, model: Any, evidence: RunEvidence) -> str | None:
        if evidence.compiled_calls <= 0:
            return "compile was requested but the compiled forward was never called (transformers fell back to eager)"
        return None

    def conflicts_with(self, other: Technique) -> str | None:
        if other.name in ("quantized_cache", "offloaded_cache"):
            return "torch.compile needs a compileable (static) cache"
        return None


# --- caches ---------------------------------------------------------------------------------------
