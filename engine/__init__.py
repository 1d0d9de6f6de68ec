"""The trainwright training engine.

Small and explicit, one concept per file:

- ``launch``          the entry point: ``python -m engine.launch RECIPE_DIR [--set key=value ...]``
- ``config``          the base configuration models and the ``--set`` / YAML layering
- ``distributed``     process group, device and the (dp, sp, tp) device mesh
- ``rank_store``      how a one-node launcher hands rank 0 the store's listening socket (stdlib)
- ``heartbeat``       a run over several nodes ends soon after a node stops answering (a cut network)
- ``blocks``          a model's repeated blocks: the one definition FSDP2 and the skills use
- ``vision_language`` a vision-language model's parts by module name: the skills' and the estimate's
- ``fsdp``            FSDP2 ``fully_shard`` per block and on the root
- ``fsdp_quantized``  bitsandbytes' 4-bit layers under FSDP2: packed weights sharded, ``quant_state`` on the layer
- ``sequence_parallel`` Ulysses all-to-all attention
- ``grad_clip``       gradient clipping that works across DTensor meshes
- ``checkpoint``      DCP checkpoints that are published atomically
- ``checkpoint_manifest`` what verifies a checkpoint: its files' sizes and SHA-256 (torch-free)
- ``engine``          the ``Engine`` base class: lifecycle and training loop
- ``metrics``         the aggregating metric logger and its backends
- ``flops``           model FLOPs per token and MFU
- ``optimizers``      the optimizers ``optim.name`` chooses beside AdamW (8-bit AdamW) and their state bytes
- ``memory``          a process's peak memory, the one definition
- ``estimate``        a run's memory and step time before it starts
- ``estimate_changes`` the changes that would make a run fit, each estimated again
- ``chat``            chat templates as they are: tokens and the assistant mask
- ``chat_messages``   chat messages as data holds them: reasoning, tool calls, tool results, tools
- ``data_files``      the data files a run may read, confined and listed
- ``data_formats``    file kinds and record formats (Alpaca, ShareGPT, parquet, CSV, ...)
- ``token_store``     a run's data tokenized once, on disk, mapped by every rank and later run
- ``store_lock``      a store's lock: its holder named, a waiter that gives up on a stalled or endless build
- ``store_check``     what a data-cache folder must be to be read as a store (its meta.json and index agree)
- ``written_trees``   removing a folder a run or recipe wrote, following no link, however deep it nests
- ``store_parts``     a token store built over the cores, a part of the data per worker: the store one process builds
- ``data_stream``     data.streaming: shards read while training, a background tokenizer, the position in the checkpoint
- ``model_io``        export, sample, evaluate: ``python -m engine.model_io``
- ``benchmarks``      lm-evaluation-harness scores of a checkpoint (``evaluate --task``)
- ``hf_checkpoint``   a script run's Hugging Face checkpoint folder, loaded and evaluated for them
- ``hf_export``       a trained model as a Hugging Face folder
- ``gguf_export``     a Hugging Face folder as one GGUF file (llama.cpp, Ollama)
- ``openmp``          how a run's OpenMP threads wait: spinning, throttled beside competitors
- ``run_dir``         the on-disk run directory format: run.json's ``RunRecord`` (torch-free; the server reads it)
- ``data_summary``    run.json's ``data``: ``DataSummary`` and ``DataPreparation``, counts bounded (torch-free)
- ``run_checkpoints`` a run's checkpoints: names, which are complete, the one chooser (torch-free)
- ``run_metrics``     metrics.jsonl: ``MetricRecord``, its bounded readers, a run's speed (torch-free)
- ``run_files``       opening and writing run files: following no link, locked, atomic (torch-free)
- ``seams``           what the engine's processes hand the server, validated on read (torch-free)
- ``errors``          the one error family (stdlib only)

Importing this package must not import torch: the MCP server imports ``engine.run_dir``.
"""
