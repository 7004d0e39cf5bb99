"""Log records that are noise to a user of the plugin, dropped by filters on the loggers themselves.

Installed when this module is imported: the plugin imports it when pytest loads it, before any conftest can
import bitsandbytes (which logs while it is imported), and a filter on the logger itself holds in every
process, xdist workers included, whatever handlers are configured later.
"""

from __future__ import annotations

import logging
import os


class _DropNeverStopWarning(logging.Filter):
    """transformers warns that a negative EOS id never stops generation: that is the point here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "should consist of positive integers" not in record.getMessage()


logging.getLogger("transformers.generation.utils").addFilter(_DropNeverStopWarning())


# why bitsandbytes could not load its hub kernel, when it then simply uses its own CPU kernels: the
# package is absent; (kernels >= 0.19, which transformers 5.25 installs) the repository is not trusted, as
# remote code should not be by default; or the Hub is off (HF_HUB_OFFLINE=1) and the kernel not cached
_EXPECTED_HUB_KERNEL_REFUSALS = ("No module named 'kernels'", "could not verify publisher trust status",
                                 "Hugging Face Hub is in offline mode")


class _DropMissingKernelsPackage(logging.Filter):
    """bitsandbytes (CPUs with AVX512-BF16) tries on import to load a CPU kernel from the Hub and warns when it
    cannot; it then uses its own CPU kernels. The expected refusals are dropped; any other failure still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("gemm_4bit_forward from kernels-community" in message
                    and any(refusal in message for refusal in _EXPECTED_HUB_KERNEL_REFUSALS))


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_DropMissingKernelsPackage())

TORCH_TRACE_VARIABLES = ("TORCH_TRACE", "TORCH_DTRACE", "TORCH_COMPILE_DEBUG")


class _DropTorchTrace(logging.Filter):
    """torch's structured compile trace (``torch.__trace``) is always at DEBUG and never propagates;
    pytest attaches its capture handlers to every non-propagating logger, so a failing test that
    compiled shows thousands of empty DEBUG records. Kept when the user asked for a trace."""

    def filter(self, record: logging.LogRecord) -> bool:
        return any(os.environ.get(name) not in (None, "", "0") for name in TORCH_TRACE_VARIABLES)


logging.getLogger("torch.__trace").addFilter(_DropTorchTrace())


class _DropPersistentManagerWarning(logging.Filter):
    """transformers warns that a persistent manager is sized for this workload: it is, and it is freed after the call."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "persistent_manager=True" not in record.getMessage()


logging.getLogger("ContinuousBatchingLogger").addFilter(_DropPersistentManagerWarning())
