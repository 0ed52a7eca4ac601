"""What a captured program is made of, read before any analysis: the operator kinds and families
(:mod:`~fxstab.capture.opsets`), stable operator names and module paths
(:mod:`~fxstab.capture.naming`), the reading of a captured ``torch.fx`` graph
(:mod:`~fxstab.capture.graph`), the flattening of a call's arguments
(:mod:`~fxstab.capture.flat`) and the user's own operators (:mod:`~fxstab.capture.user_ops`).
"""

from . import flat, graph, naming, opsets, user_ops

__all__ = ["opsets", "naming", "graph", "flat", "user_ops"]
