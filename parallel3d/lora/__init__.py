"""LoRA: low-rank adapters on the tensor-parallel layers, the base weights frozen.

    adapters.py  the adapter factors on a column-, row-parallel or plain linear layer,
                 split as the layer's weight, and the forward that adds them
    apply.py     apply_lora (targets, freezing, the job's checks), the seeded init
    peft_io.py   PEFT adapter folders in (this rank's slices)
"""

from .adapters import LoraFactor, adapter_parameters, attach
from .apply import apply_lora, init_adapters_, lora_problems, start_adapters_
from .peft_io import load_adapter_

__all__ = ["LoraFactor", "adapter_parameters", "apply_lora", "attach", "init_adapters_",
           "load_adapter_", "lora_problems", "start_adapters_"]
