"""`mea-demo`: a small MoE GPT pretrained with MEA, KHA and the baseline on CPU (`pipeline`), each
variant's run kept, continued or started again on a rerun (`runs`)."""
