"""The numbers of inference: FLOP and byte arithmetic, capacity planning, the roofline and its probes, and the
serving metrics (TTFT, TPOT, ITL, throughput, goodput)."""
