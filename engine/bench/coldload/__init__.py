"""Cold-load latency studies of the loraplex engine (``loraplex bench coldload``).

N synthetic PEFT adapters are served by name from a local folder, a local S3 server or a local
fake Hugging Face Hub; an open-loop workload (Poisson arrivals, Zipf adapter popularity) drives
the engine in-process; each request's TTFT is split into queue, load stages, H2D and prefill,
and inter-token latency is compared with and without a load in flight. See docs/coldload.md.
"""
