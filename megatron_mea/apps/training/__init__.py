"""`mea-pretrain`: Megatron-Core pretraining with MEA / KHA (arguments, model, loop, checkpoints)."""
