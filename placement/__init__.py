"""moe-placement: where the experts of a mixture-of-experts model live when served on many GPUs.

The shared data model (:class:`Topology`, :class:`Placement`), metrics and engine formats.
The CLI lives in the top-floor package :mod:`cli`; nothing here imports it.
"""

from placement.model import Placement, compute_logical_maps, validate_map
from placement.topology import Topology

__all__ = ["Placement", "Topology", "compute_logical_maps", "validate_map"]
__version__ = "0.1.0"
