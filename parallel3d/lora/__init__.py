"""LoRA: low-rank adapters on the tensor-parallel layers, the base weights frozen.

    adapters.py  the adapter factors on a column-, row-parallel or plain linear layer,
                 split as the layer's weight, and the forward that adds them
    apply.py     apply_lora (targets, freezing, the job's checks), the seeded init
    peft_io.py   PEFT adapter folders in (this rank's slices)
    merge.py     merge_and_unload_: the adapters folded into the weights, shard by shard
"""

from .adapters import LoraFactor, adapter_parameters, attach, detach
from .apply import apply_lora, init_adapters_, lora_problems, start_adapters_
from .merge import merge_and_unload_
from .peft_io import load_adapter_

__all__ = ["LoraFactor", "adapter_parameters", "apply_lora", "attach", "detach", "init_adapters_",
           "load_adapter_", "lora_problems", "merge_and_unload_", "start_adapters_"]
