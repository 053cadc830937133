"""The adapter lifecycle: what decides over time which adapter is where.

Names and versions (``registry``, ``version``), getting an adapter's files (``fetch``: sources,
fetch, verify, preflight, value checks, the staging directory), the checks and parsing
(``preflight``, ``checks``, ``parse``, ``peft_config``, ``targets``, ``regex_bounds``,
``files``, ``digest``, ``added_tokens``, ``combine``), the stage step into host memory
(``staging``, ``host_pool``, ``thread_jobs``, ``loader_procs`` / ``loader_proc_main``), and the
GPU slots' table and writer (``slot_store``, ``slot_writer``). It imports the model side
(``engine/model/``), never the other way.
"""
