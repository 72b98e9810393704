"""Import shims that let the peers load here without changing torch. Import this module first.

Applied once, at import (idempotent), in every process that imports it: the benchmark process and, through
the adapters' dataset classes that live in modules importing this one, every spawned DataLoader worker.

1. torchvision. mosaicml-streaming imports torchvision at ``import streaming`` (``streaming.vision``) and lists
   it as a dependency, as does litdata. The only torchvision wheel reachable here (0.28.0, the one matching
   torch 2.13.0) is built against the CUDA build of torch: its ``_C`` extension links ``libtorch_cuda.so`` and
   does not load against the CPU build. torchvision then still imports, except that
   ``torchvision/_meta_registrations.py`` registers fake kernels for ``torchvision::nms`` and
   ``torchvision::qnms`` unconditionally and fails with ``operator torchvision::nms does not exist``. When the
   extension cannot load, we define those two operator schemas with ``torch.library`` (the schema torchvision
   itself declares). torchvision's compiled image ops then raise if called; the benchmarks call none.
2. litdata. Its chunk downloader (obstore) refuses a plain-http endpoint such as the local moto server unless
   ``allow_http`` is set in its client options, and litdata exposes no setting for them; we add
   ``allow_http`` to its module-level client options. Only a loopback test endpoint needs this.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_TORCHVISION_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_state: dict[str, Any] = {}


def torchvision_extension_loads() -> bool | None:
    """Whether torchvision's compiled extension loads against this torch (``None``: torchvision is absent)."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return None
    import torch

    for library in sorted(Path(spec.origin).parent.glob("_C*.so")):
        try:
            torch.ops.load_library(str(library))  # type: ignore[no-untyped-call]
        except OSError as exc:
            _state["torchvision_error"] = str(exc).splitlines()[0]
            return False
        return True
    return False


def patch_torchvision() -> str:
    """Define the operator schemas torchvision's import needs when its extension cannot load."""
    if "torchvision" in _state:
        return str(_state["torchvision"])
    loads = torchvision_extension_loads()
    if loads is None:
        outcome = "absent"
    elif loads:
        outcome = "extension loads; no patch needed"
    else:
        import torch

        library = torch.library.Library("torchvision", "DEF")  # type: ignore[no-untyped-call]
        for schema in _TORCHVISION_SCHEMAS:
            library.define(schema)  # type: ignore[no-untyped-call]
        _state["torchvision_library"] = library  # the definitions live as long as this object
        outcome = f"extension does not load ({_state.get('torchvision_error')}); defined nms/qnms schemas"
        logger.info("torchvision: %s", outcome)
    _state["torchvision"] = outcome
    return outcome


def patch_litdata_http() -> str:
    """Let litdata's obstore downloader talk to a plain-http endpoint (loopback moto)."""
    if "litdata" in _state:
        return str(_state["litdata"])
    if importlib.util.find_spec("litdata") is None:
        outcome = "absent"
    else:
        from litdata.streaming import downloader

        options = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None)
        if isinstance(options, dict):
            options["allow_http"] = True
            outcome = "allow_http set in litdata.streaming.downloader._OBSTORE_CLIENT_OPTIONS"
        else:
            outcome = "litdata has no _OBSTORE_CLIENT_OPTIONS dict; not patched"
    _state["litdata"] = outcome
    return outcome


def report() -> dict[str, str]:
    """What was patched in this process, for the benchmark report."""
    return {key: str(value) for key, value in _state.items() if key in ("torchvision", "litdata")}


patch_torchvision()
