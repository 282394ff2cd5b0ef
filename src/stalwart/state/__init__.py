"""What a training run is, as one state dict: ``TrainState`` and its parts.

``train_state`` (TrainState, the sections of its state dict), ``units``
(modules and optimizers, matched into what DCP saves together), ``per_rank``
(values that differ between ranks), ``native`` (the fast path of DCP's
``get_state_dict`` on saves), ``plain`` (what a non-tensor value may be),
``restore`` (TrainState's ``RestorePlan``).
"""

from stalwart.state.restore import flat_keys
from stalwart.state.train_state import TrainState

__all__ = ["TrainState", "flat_keys"]
