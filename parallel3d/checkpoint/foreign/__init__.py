"""Other frameworks' formats, read (and some written) by the converter and the trainer:
Hugging Face folders and PEFT adapters, torch DCP folders, DeepSpeed ZeRO and Megatron-Core
checkpoints, and ``torch.save`` archives read without running their code. parallel3d's own
format, its reader and writers, and what every source serves (:mod:`..source`,
:mod:`..mapped`) are one level up."""
