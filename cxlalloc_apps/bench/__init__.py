"""cxlalloc's benchmarks: ``python -m cxlalloc bench`` (:mod:`.cli`).

Modules:
    meta         JSON records: metadata (hardware, software, command, date), writer, validation
    timing       CUDA-event and CPU timers, deadlines
    guard        the managed-memory guard (never more than half the card's free memory)
    model        Llama-shaped models with random weights; the link-bound ceiling model
    ceilings     device / host-tier copy and zero-copy read bandwidths (GPU)
    allocation   malloc/free latency per tier and backend vs raw driver calls (GPU); throughput (simulation)
    decode       generate() under forced KV spill, every variant side by side (GPU; toy in simulation)
    worker       one decode worker process per variant group
    rightsizing  largest batch and tokens/s at a fixed budget (GPU)
    report       plots and the README results table from the records

See benchmarks/README.md for what each measures and how to run it on a GPU.
"""
