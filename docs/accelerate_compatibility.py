"""Generate docs/accelerate-compatibility.md: Accelerate 1.15's public surface checked against impel.

Run in the dev venv (accelerate is installed there): ``.venv/bin/python docs/accelerate_compatibility.py``.
"""
import importlib
import inspect
import os
import pkgutil
import sys
import types
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
import accelerate
import accelerate.state
import accelerate.utils

import impel
import impel.state
import impel.utils as iu
from impel.accelerator import Accelerator as IAcc
from impel.accelerator.not_provided import NotProvidedMember
from impel.config.unsupported import ACCELERATES_OWN, REASONS

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "unit"))
import test_accelerate_signatures as signatures  # noqa: E402  (the compared signatures and the listed differences)

# --- reasons for names impel does not have, or has with limits ------------------------------------------------
MISSING = {
    # top level
    "cpu_offload": "big-model inference (dispatch / offload hooks) is not in impel's scope: impel trains",
    "cpu_offload_with_hook": "big-model inference is not in impel's scope",
    "disk_offload": "big-model inference is not in impel's scope",
    "dispatch_model": "big-model inference is not in impel's scope",
    "infer_auto_device_map": "big-model inference is not in impel's scope",
    "load_checkpoint_and_dispatch": "big-model inference is not in impel's scope; use load_checkpoint_in_model",
    "prepare_pippy": "pipeline-parallel inference (PiPPy) is not in impel's scope",
    # utils
    "FP8RecipeKwargs": "impel has no fp8 mode", "AORecipeKwargs": "impel has no fp8 mode",
    "TERecipeKwargs": "impel has no fp8 mode", "MSAMPRecipeKwargs": "impel has no fp8 mode",
    "MegatronLMPlugin": "impel does not drive Megatron-LM",
    "MegatronLMDummyScheduler": "impel does not drive Megatron-LM",
    "MegatronLMDummyDataLoader": "impel does not drive Megatron-LM",
    "TorchTensorParallelPlugin": "deprecated in Accelerate; use ParallelismConfig(tp_size=...)",
    "DeepSpeedSequenceParallelConfig": "sequence parallelism is not supported",
    "BnbQuantizationConfig": "quantised loading is not in impel's scope",
    "load_and_quantize_model": "quantised loading is not in impel's scope",
    "HfDeepSpeedConfig": "impel resolves the DeepSpeed JSON itself; pass it as DeepSpeedPlugin(hf_ds_config=...)",
    "ProjectConfiguration": None,
    "write_basic_config": "use `impel config default`",
    "get_max_memory": "big-model inference helper, not in impel's scope",
    "load_fsdp_model": "use accelerator.load_state", "save_fsdp_model": "use accelerator.save_state",
    "load_fsdp_optimizer": "use accelerator.load_state", "save_fsdp_optimizer": "use accelerator.save_state",
    # Accelerator members
    "arg:mixed_precision": None,
    "arg:dispatch_batches": "removed from Accelerate's signature long ago; DataLoaderConfiguration holds it",
}
LIMITS = {
    "arg:torch_tp_plugin": "Accelerate's deprecated spelling of parallelism_config=ParallelismConfig(tp_size=...): "
                           "mapped onto it with Accelerate's FutureWarning; with parallelism_config too it raises",
    "arg:megatron_lm_plugin": "accepted; a plugin given raises NotProvidedError (impel does not drive Megatron-LM)",
    "arg:deepspeed_plugins": "Accelerate's alias of deepspeed_plugin: a plugin or {name: plugin, ...}; with several, "
                             "each JSON is settled at Accelerator(...), the first is active and prepare builds each "
                             "engine with the active plugin's JSON (stage, clipping, checkpoint); every plugin runs at "
                             "the run's mixed precision (another raises NotProvidedError). See docs/deepspeed.md",
    "arg:deepspeed_plugin": "a plugin or a {name: plugin, ...} dict (see deepspeed_plugins)",
    "has_fp8_handler": "always False: impel has no fp8 mode",
    "has_lomo_optimizer": "always False: impel does not drive LOMO optimizers",
    "state:deepspeed_plugins": "{name: plugin} when given by name, else the plugin (None without DeepSpeed)",
    "state:get_deepspeed_plugin": "the plugin given as deepspeed_plugins={name: plugin}",
    "state:select_deepspeed_plugin": "makes the named plugin active (its selected flag, accelerator.deepspeed_plugin): "
                                     "the next prepare, init_context() and transformers' ZeRO-3 detection use it",
    "DistributedType": "all members exist; selecting XLA, MULTI_NPU/MLU/SDAA/MUSA/XPU/HPU/NEURON or MEGATRON_LM as "
                       "distributed_type raises naming what impel runs (NO, MULTI_CPU, MULTI_GPU, FSDP, DEEPSPEED)",
    "DistributedDataParallelKwargs": "comm_hook (fp16, bf16, power_sgd, batched_power_sgd), comm_wrapper (fp16 / bf16 "
                                     "around a PowerSGD hook) and comm_state_option (PowerSGDState's arguments) are "
                                     "registered on the DDP model with torch's hooks, as Accelerate does; plain "
                                     "strings work too (Accelerate registers only enum members and silently ignores "
                                     "strings). Raise instead of doing nothing: a wrapper or comm_state_option "
                                     "without a PowerSGD hook, unknown PowerSGDState arguments, a hook under FSDP / "
                                     "DeepSpeed, bf16 where torch's DDP refuses it (CPU builds), batched_power_sgd "
                                     "where torch's hook fails at its first compressed iteration (torch 2.13)",
    "DDPCommunicationHookType": "same members and values; a str enum, so plain strings are equivalent (see "
                                "DistributedDataParallelKwargs)",
    "accelerate.local_sgd": "LocalSGD: same constructor, context manager, step() and numbers on DDP (MULTI_CPU / "
                            "MULTI_GPU); a no-op on one process; FSDP / DeepSpeed raise NotImplementedError; leaving "
                            "the block by an exception skips the final (collective) average",
    "PrecisionType": "FP8 exists as a name; mixed_precision='fp8' raises",
    "LoggerType": "all members, and `'wandb' in LoggerType` / `LoggerType.list()` as Accelerate's (a str enum, so "
                  "plain strings are equivalent); impel builds tensorboard, wandb, mlflow, trackio and all (plus its "
                  "own 'jsonl'); aim, comet_ml, clearml, dvclive and swanlab raise when asked for, naming the ones it "
                  "builds",
    "accelerate.tracking": "GeneralTracker (same contract, same error for a class missing name / "
                           "requires_logging_directory / tracker), on_main_process, register_tracker_class, "
                           "get_available_trackers, LOGGER_TYPE_TO_CLASS and the TensorBoard / W&B / MLflow / trackio "
                           "trackers, constructed as Accelerate's (JSONLTracker is impel's own). Not provided: the "
                           "Aim, Comet, ClearML, DVCLive and SwanLab trackers (they import and raise "
                           "NotProvidedError on use), filter_trackers, and the built-in "
                           "trackers' log_images / log_table / log_figure / log_artifact(s) (use get_tracker(name, "
                           "unwrap=True))",
    "notebook_launcher": "single machine or several (same call on each) through torch's elastic agent; use_port=0 "
                         "picks a free port",
    "debug_launcher": "CPU ranks over gloo through torch's elastic agent",
    "load_checkpoint_in_model": "offload_folder / offload_state_dict / offload_buffers / offload_8bit_bnb / "
                                "broadcast_from_rank0 / full_state_dict=False and device_map 'disk' raise: no "
                                "offloading or quantisation. `dtype` applies also without a device_map (Accelerate "
                                "ignores it there)",
    "synchronize_rng_state": "torch, cuda, generator; other device kinds raise",
    "synchronize_rng_states": "torch, cuda, generator; other device kinds raise",
    "find_executable_batch_size": "as Accelerate 1.15: the batch size is multiplied by 0.9 after each out-of-memory "
                                  "error",
    "merge_fsdp_weights": "from an impel checkpoint directory or a bare DCP directory (Accelerate's "
                          "pytorch_model_fsdp_0)",
    "is_fp8_available": "always False: impel has no fp8 mode",
    "join_uneven_inputs": "DDP (MULTI_CPU and MULTI_GPU, where Accelerate only honours MULTI_GPU); FSDP / DeepSpeed "
                          "raise (torch has no Join for them)",
    "load_state": "also loads a directory written by Accelerate's `save_state` (docs/checkpoints.md, \"Checkpoints\"); "
                  "`strict=False` lets model keys differ (named in a warning); `map_location` None / 'cpu' / "
                  "'on_device' and load_kwargs={'map_location': ...} are accepted (impel copies into the prepared "
                  "objects wherever they live); other keywords go to DeepSpeed's engine.load_checkpoint under "
                  "DeepSpeed and raise elsewhere; load_kwargs weights_only=False raises",
    "save_state": "extra keywords go to DeepSpeed's engine.save_checkpoint (as in Accelerate); elsewhere they raise "
                  "instead of being ignored; impel's `async_save=True` returns once the state is staged and writes "
                  "in the background (docs/checkpoints.md, \"Asynchronous saves\")",
    "gradient_accumulation_steps": "settable; raises under DeepSpeed (its engine fixes it) or mid-group",
    "save": "main process only (each node's with save_on_each_node); safetensors for a dict of tensors",
    "dispatch_batches": "DataLoaderConfiguration's: True dispatches every batch from rank 0, as Accelerate; "
                        "None (the default) dispatches iterable datasets, as Accelerate",
    "rng_types": "default ['generator'] as in Accelerate: the sampler's generator is rank 0's (agreed at prepare); "
                 "'torch' / 'cuda' are shared from rank 0 at each pass; other kinds raise",
    "DataLoaderConfiguration": "all of Accelerate's fields and defaults, and the same batches per rank and global RNG "
                               "draws (tests/unit/test_data_order_matches_accelerate.py); dispatch_batches=True: "
                               "rank 0 reads and sends each rank its slice, with Accelerate's batches "
                               "(tests/multiprocess/test_dispatch_batches_matches_accelerate.py); data_seed without "
                               "use_seedable_sampler changes nothing, as in Accelerate (a warning says so); "
                               "use_stateful_dataloader holds "
                               "either way (prepared loaders always save and restore their position)",
    "TorchDynamoPlugin": "same fields and defaults (None fields take the launched dynamo_config / --dynamo_* values, "
                         "as Accelerate's take its environment); prepare compiles after the DDP wrapper and returns "
                         "the OptimizedModule; use_regional_compilation compiles the repeated blocks in place (names "
                         "unchanged) on every strategy; under FSDP2 each block is compiled before sharding "
                         "(torchtitan's recipe) whether regional or not; under DeepSpeed a backend raises (not "
                         "supported yet); an unknown backend, or one whose package / hardware is missing or that "
                         "torch removed (aot_ts_nvfuser, nvprims_nvfuser, ofi), raises when the Accelerator is built, "
                         "naming it and the fix",
    "DynamoBackend": "same members and values (a str enum; `'INDUCTOR' in DynamoBackend` works); see "
                     "TorchDynamoPlugin for which can run",
    "is_compiled_module": "as Accelerate's (an OptimizedModule)",
    "has_compiled_regions": "also true for blocks compiled in place (impel's regional compilation), which "
                            "Accelerate's misses",
    "arg:dynamo_backend": "a name or DynamoBackend member; see TorchDynamoPlugin",
    "arg:dynamo_plugin": "see TorchDynamoPlugin; passing it with dynamo_backend raises, as in Accelerate",
    "unwrap_model": "keep_fp32_wrapper and keep_torch_compile as Accelerate's; a compiled DDP model unwraps to a new "
                    "OptimizedModule around the unwrapped module (Accelerate re-points the prepared one); regionally "
                    "compiled blocks stay compiled with keep_torch_compile=False (compiled in place)",
    "get_state_dict": "original parameter names for compiled models too (no `_orig_mod.`), as save_state and "
                      "save_model",
    "init_trackers": "as Accelerate: each tracker named in log_with is built with init_kwargs[name] (SummaryWriter's, "
                     "wandb.init's, MLflow's experiment / run arguments, trackio.init's), GeneralTracker instances "
                     "are used as given, then start() and store_init_configuration(config); runs land where "
                     "Accelerate's do (TensorBoard in logging_dir/project_name, W&B project and trackio project "
                     "project_name, MLflow experiment project_name under MLflow's tracking URI). Differences: a "
                     "tracker with main_process_only=False runs on every process (Accelerate calls trackers on the "
                     "main process only); a second call raises; TensorBoard with neither project_dir nor logging_dir "
                     "writes under '.' (Accelerate raises when the Accelerator is built); TensorBoard takes any "
                     "config (values other than numbers, strings and bools become text in the hparams; Accelerate "
                     "raises)",
    "log": "as Accelerate: log_kwargs[name] reach each tracker's log (add_scalar / add_text / add_scalars, wandb's "
           "run.log, mlflow.log_metrics, trackio's run.log) and step=None reaches them as None (impel's JSONL rows "
           "carry accelerator.step). Tensors become numbers (Accelerate's MLflow drops them, trackio skips them); a "
           "value a tracker cannot store (a list for TensorBoard; a string, dict or list for MLflow) is dropped with "
           "one warning naming the key (Accelerate: silently for TensorBoard)",
    "get_tracker": "the tracker, or with unwrap=True its SummaryWriter / wandb run / MLflow run / trackio run; a "
                   "blank no-op GeneralTracker where the tracker does not run (another process), as Accelerate",
    "log_with": "the names, LoggerType values (as strings) and GeneralTracker instances asked for, 'all' expanded to "
                "the installed trackers",
    "arg:log_with": "names, LoggerType members, names registered with register_tracker_class and GeneralTracker "
                    "instances, as Accelerate; a named tracker whose package is missing raises with the pip install "
                    "(Accelerate drops it with a debug message)",
    "trackers": "the trackers running on this process (the main process's; on every process those with "
                "main_process_only=False)",
    "state": "an AcceleratorState (PartialState plus distributed_type, mixed_precision, deepspeed_plugin, fsdp_plugin)",
    "deepspeed_plugin": "the active plugin (passed in code, else one built from the launched config); its "
                        "deepspeed_config is the settled JSON, filled with each engine's concrete values at prepare "
                        "(as Accelerate's), and get_value, is_auto, fill_match, deepspeed_config_process, selected, "
                        "is_zero3_init_enabled work as Accelerate's; zero3_init_context_manager raises "
                        "NotProvidedError",
    "ParallelismConfig": "Accelerate's fields, properties and mesh (dims dp_replicate, dp_shard, cp, tp; flattened dp, "
                         "dp_shard_cp, dp_cp); the sizes are checked against the world size when the Accelerator is "
                         "built (and by impel launch). Differences: tensor parallelism is applied at prepare from the "
                         "model's transformers plan or TorchTensorParallelConfig(tp_plan=...) (Accelerate only takes "
                         "models transformers already split); sp_size > 1 (DeepSpeed Ulysses) raises; all sizes 1 "
                         "under FSDP shard over every rank (Accelerate raises). See docs/parallelism.md",
    "TorchTensorParallelConfig": "enable_async_tp=True raises (Accelerate ignores it with a warning); tp_plan is "
                                 "impel's: a plan for models without one",
    "TorchContextParallelConfig": "cp_comm_strategy as Accelerate's (allgather / alltoall)",
    "gather_for_metrics": "under tensor / context parallelism, one copy per data-parallel rank (Accelerate 1.15 "
                          "gathers the TP ranks' copies too)",
    "tensor_parallel_rank": "the rank along the mesh's tp dim (RuntimeError without a parallelism_config, as "
                            "Accelerate)",
    "context_parallel_rank": "the rank along the mesh's cp dim (Accelerate raises NotImplementedError)",
    "pipeline_parallel_rank": "NotImplementedError, as Accelerate",
    "should_save_model": "True on every rank, as Accelerate 1.15 (saving is collective)",
    "reduce": "default 'mean' (accelerate.utils.reduce's; the Accelerator's method keeps 'sum', as Accelerate's), "
              "'sum', 'max' as Accelerate; 'min' takes the minimum and 'none' leaves each rank's tensor (Accelerate "
              "sums for both); `scale` multiplies on every device (Accelerate applies it on XLA only); another "
              "reduction raises",
    "recursively_apply": "Accelerate's signature (func, data, *args, test_type=, error_on_other_type=False, **kwargs)",
    "extract_model_from_parallel": "strips DataParallel / DDP / a DeepSpeed engine, inside torch.compile too; FSDP2 "
                                   "shards in place, so `recursive` changes nothing",
    "prepare_model": "evaluation_mode=True prepares the model as for training (same outputs; Accelerate leaves out "
                     "the DDP wrapper)",
    "prepare_optimizer": "device_placement=False raises (the optimizer state lives with its parameters)",
    "prepare_data_loader": "slice_fn_for_dispatch cuts each rank's part of a dispatched batch "
                           "(DataLoaderConfiguration(dispatch_batches=True)); on a loader that is not dispatched it "
                           "raises (Accelerate ignores it)",
    "accelerate.data_loader": "DataLoaderStateMixin: prepared loaders are instances; a subclass gets "
                              "end_of_dataloader / remainder / reset() (begin() / end(), which register with "
                              "Accelerate's GradientState internals, raise). DataLoaderShard and "
                              "DataLoaderDispatcher: Accelerate's constructors, batches, lengths, skip_batches and "
                              "iteration when built directly (tests/unit/test_accelerate_loaders_direct.py, "
                              "tests/multiprocess/test_dispatch_batches_matches_accelerate.py), and what "
                              "accelerator.prepare returns (a DataLoaderDispatcher with dispatch_batches=True, else a "
                              "DataLoaderShard); prepare_data_loader(dispatch_batches=True) dispatches as "
                              "Accelerate's, dispatch_batches=None dispatches an iterable dataset when "
                              "put_on_device=True, as Accelerate's function; a loader with "
                              "batch_size=None prepares as Accelerate's on one process (keeping its sampler) and is "
                              "dealt sample by sample on several (Accelerate's fails there)",
    "trigger_sync_in_backward": "DDP: the next backward in the block reduces gradients (as Accelerate's); "
                                "elsewhere nothing to do",
    "state:_reset_state": "provided because transformers calls it: forgets the state, keeps the process group; "
                           "an Accelerator built before it keeps working (Accelerate's raises AttributeError on its "
                           "next use, which two of Accelerate's unit tests and test_script's "
                           "test_reinstantiated_state expect; docs/testing.md)",
    "state:debug": "collectives check shapes across ranks first (DistributedOperationException), also with "
                   "ACCELERATE_DEBUG_MODE=1",
    "state:split_between_processes": "lists, tuples, dicts, tensors and datasets.Dataset, as Accelerate",
    "state:destroy_process_group": "without a group: only a group impel created; with one: that group",
    "GradientState": "impel keeps one per Accelerator: GradientState() without a plugin raises, naming "
                     "accelerator.gradient_state",
}

# accelerate.utils names that scripts (accelerate's examples, transformers / diffusers / trl scripts) import
UTILS_USED = sorted(set(iu.__all__) | {
    "ParallelismConfig", "TorchDynamoPlugin", "DynamoBackend", "FP8RecipeKwargs", "AORecipeKwargs", "TERecipeKwargs",
    "MSAMPRecipeKwargs", "MegatronLMPlugin", "MegatronLMDummyScheduler", "TorchTensorParallelPlugin",
    "HfDeepSpeedConfig", "extract_model_from_parallel", "write_basic_config", "patch_environment",
    "convert_outputs_to_fp32", "get_max_memory", "load_fsdp_model", "save_fsdp_model", "load_fsdp_optimizer",
    "save_fsdp_optimizer", "BnbQuantizationConfig", "load_and_quantize_model"})


def placeholder(value):
    """A NotProvidedError placeholder, or Accelerate's own object that impel's name is (ACCELERATES_OWN)."""
    return type(value).__module__ == "impel.config.unsupported" or \
        getattr(value, "__module__", "").startswith("accelerate.")


def has(module, name):
    """The name resolves to something real (a placeholder that raises NotProvidedError on use does not count)."""
    try:
        return not placeholder(getattr(module, name))
    except AttributeError:
        return False


def row(name, present):
    if present == "refused":  # an Accelerator member that raises NotProvidedError on use
        return f"| `{name}` | not provided (NotProvidedError on use) | {getattr(IAcc, name).reason} |"
    if present:
        note = LIMITS.get(name, "")
        return f"| `{name}` | supported | {note} |"
    if name in ACCELERATES_OWN:
        return f"| `{name}` | Accelerate's own when installed (else NotProvidedError on use) | {REASONS[name]} |"
    if name in REASONS:
        return f"| `{name}` | not provided (imports; NotProvidedError on use) | {REASONS[name]} |"
    return f"| `{name}` | missing (AttributeError) | {MISSING.get(name) or 'not provided yet'} |"


def section(title, names, present):
    out = [f"## {title}", "", "| name | impel | notes |", "|---|---|---|"]
    out += [row(n, present(n)) for n in names]
    n_ok = sum(present(n) is True for n in names)
    return out + ["", f"{n_ok} of {len(names)} present.", ""]


signatures_subs = ["dataclasses", "operations", "memory", "random", "modeling", "imports", "other", "constants",
                   "deepspeed", "environment", "fsdp_utils", "launch", "versions"]
top = sorted(n for n in dir(accelerate)
             if not n.startswith("_") and not isinstance(getattr(accelerate, n), types.ModuleType))
acc_a = accelerate.Accelerator(cpu=True)
cls_members = {n for n in dir(accelerate.Accelerator) if not n.startswith("_")}
members = sorted(cls_members | {n for n in vars(acc_a) if not n.startswith("_")})
acc_i = IAcc(cpu=True)
paths = [("accelerate.accelerator", "impel.accelerator", ["Accelerator"]),
         ("accelerate.state", "impel.state", ["PartialState", "AcceleratorState", "GradientState"]),
         ("accelerate.logging", "impel.logging", ["get_logger", "MultiProcessAdapter"]),
         ("accelerate.data_loader", "impel.data_loader", ["skip_first_batches", "DataLoaderShard",
                                                          "prepare_data_loader", "BatchSamplerShard",
                                                          "IterableDatasetShard", "SeedableRandomSampler",
                                                          "SkipBatchSampler", "SkipDataLoader",
                                                          "DataLoaderDispatcher", "DataLoaderStateMixin"]),
         ("accelerate.commands.config", "impel.commands.config", ["default_config_file", "load_config_from_file"]),
         ("accelerate.big_modeling", "impel.big_modeling", ["init_empty_weights", "init_on_device"]),
         ("accelerate.launchers", "impel.launchers", ["notebook_launcher", "debug_launcher"]),
         ("accelerate.local_sgd", "impel.local_sgd", ["LocalSGD"]),
         ("accelerate.tracking", "impel.tracking", ["GeneralTracker", "on_main_process", "register_tracker_class",
                                                    "get_available_trackers", "TensorBoardTracker", "WandBTracker",
                                                    "MLflowTracker", "TrackioTracker"])]

lines = ["# Accelerate compatibility", "",
         "Accelerate 1.15's public surface, listed from its own `__init__`, `accelerate.utils` (the names scripts",
         "import) and `dir(Accelerator)` plus an Accelerator instance's attributes, each checked against impel by",
         "importing it (a script in the dev venv, where accelerate is installed, wrote this file).",
         "After `sed 's/\\baccelerate\\b/impel/g'` the \"supported\" names resolve; \"not provided\" ones import",
         "and raise `NotProvidedError` (a `NotImplementedError`) naming the reason on use",
         "(`impel.config.unsupported`); `help()`, `inspect.signature`, mock autospec and completion work on them,",
         "and an attribute they lack is an AttributeError (`hasattr` is False) that names the reason;",
         "\"missing\" ones raise AttributeError / ImportError (or TypeError for constructor arguments), with the",
         "reason here: nothing is accepted and ignored. Where a supported name refuses some of its settings, the",
         "notes say which and why.",
         "`tests/unit/test_dropin_surface.py` checks that every \"supported\" row still resolves.", "",
         "## Module paths", "", "| Accelerate | impel | names checked | notes |", "|---|---|---|---|"]
for a_mod, i_mod, names in paths:
    m = importlib.import_module(i_mod)
    ok = all(has(m, n) for n in names)
    lines.append(f"| `{a_mod}` | `{i_mod}` {'supported' if ok else 'MISSING'} | {', '.join(names)} | "
                 f"{LIMITS.get(a_mod, '')} |")
lines += ["| `accelerate.utils` | `impel.utils` supported | see below | |",
          "| `accelerate.hooks` | `impel.hooks` (Accelerate's own names when installed, else NotProvidedError on "
          "use) | "
          f"{', '.join(importlib.import_module('impel.hooks').__all__)} | big-model inference hooks: "
          f"{REASONS['add_hook_to_module']} |"]
# the rest of the installed Accelerate's top-level module paths (tests/unit/test_accelerate_module_paths.py)
OTHER_PATHS = {
    "optimizer": "supported: AcceleratedOptimizer; move_to_device (impel's send_to_device); patch_optimizer_step "
                 f"imports and raises NotProvidedError on use: {REASONS['patch_optimizer_step']}",
    "scheduler": "supported: AcceleratedScheduler",
    "parallelism_config": "supported: ParallelismConfig",
    "commands": "supported: impel's commands (`impel config`, `impel launch`, `impel to-fsdp2`, ...; docs/cli.md); "
                "every `accelerate launch` flag is taken or refused with its reason (docs/launch.md), "
                "`--mpirun_hostfile` and `--deepspeed_hostfile` (with its filters and launchers, DeepSpeed's runner "
                "as Accelerate runs it) included (docs/cluster.md)",
    "memory_utils": "supported: importing it gives Accelerate's FutureWarning (it moved to utils.memory); "
                    "find_executable_batch_size and release_memory resolve",
    "checkpointing": "every name imports (save_accelerator_state, load_accelerator_state, save_custom_state, "
                     f"load_custom_state); NotProvidedError on use: {REASONS['save_accelerator_state']}",
    "inference": "every name imports (prepare_pippy, generate_device_map, find_pippy_batch_size, build_pipeline, "
                 f"pippy_forward); NotProvidedError on use: {REASONS['prepare_pippy']}",
}
listed = {a.removeprefix("accelerate.") for a, _, _ in paths} | {"utils", "hooks"}
for info in sorted(pkgutil.iter_modules(accelerate.__path__), key=lambda m: m.name):
    if info.name in listed:
        continue
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            importlib.import_module(f"impel.{info.name}")
        lines.append(f"| `accelerate.{info.name}` | `impel.{info.name}` | | {OTHER_PATHS[info.name]} |")
    except ImportError as error:  # a path impel does not provide: its ImportError names the reason
        lines.append(f"| `accelerate.{info.name}` | not provided (ImportError) | | {error} |")
lines.append("")
lines += ["## Module paths below `accelerate.utils`", "",
          "Each of Accelerate's `accelerate.utils.<submodule>` paths is a face over impel's modules. Checked: the",
          "names of each submodule that are in `accelerate.utils`' namespace (its documented names) or constants.",
          "Accelerate's big-model names are Accelerate's own objects when it is installed (NotProvidedError without",
          "it).",
          "", "| Accelerate | names | real | not provided (NotProvidedError on use) or Accelerate's own |",
          "|---|---|---|---|"]
for sub in signatures_subs:
    acc_mod = importlib.import_module(f"accelerate.utils.{sub}")
    names = [n for n in dir(acc_mod) if not n.startswith("_") and not isinstance(getattr(acc_mod, n), types.ModuleType)
             and (n in dir(accelerate.utils) or n.isupper())]
    face = importlib.import_module(f"impel.utils.{sub}")
    real = [n for n in names if has(face, n)]
    refused = [n for n in names if n in REASONS and n not in real]
    absent = [n for n in names if n not in real and n not in refused]
    extra = f"; internal, absent: {', '.join(absent)}" if absent else ""
    lines.append(f"| `accelerate.utils.{sub}` | {len(names)} | {len(real)} | {', '.join(refused) or '-'}{extra} |")
lines.append("")
lines += section("Top-level names (`import accelerate`)", top, lambda n: has(impel, n))
lines += section("`accelerate.utils` names scripts use", UTILS_USED, lambda n: has(iu, n))
def member_present(name):  # listed, not read (some raise)
    if isinstance(getattr(IAcc, name, None), NotProvidedMember):
        return "refused"
    return name in dir(acc_i)


lines += section("`Accelerator` members", members, member_present)
a_params = [p for p in inspect.signature(accelerate.Accelerator.__init__).parameters if p != "self"]
i_params = set(inspect.signature(IAcc.__init__).parameters)
lines += ["## `Accelerator(...)` arguments", "", "| argument | impel | notes |", "|---|---|---|"]
for p in a_params:
    if p in i_params:
        lines.append(f"| `{p}` | supported | {LIMITS.get('arg:' + p, '')} |")
    else:
        lines.append(f"| `{p}` | missing (TypeError) | {MISSING.get('arg:' + p, 'a separate task in issue 14')} |")
lines += ["", f"{sum(p in i_params for p in a_params)} of {len(a_params)} present.", ""]
lines += ["## State classes", "", "| member | PartialState | AcceleratorState | notes |", "|---|---|---|---|"]
state_members = sorted({n for cls in (accelerate.state.PartialState, accelerate.state.AcceleratorState)
                        for n in dir(cls) if not n.startswith("_") or n == "_reset_state"})
for n in state_members:
    cells = []
    for acc_cls, imp_cls in ((accelerate.state.PartialState, impel.state.PartialState),
                             (accelerate.state.AcceleratorState, impel.state.AcceleratorState)):
        cells.append("-" if not hasattr(acc_cls, n) else "supported" if hasattr(imp_cls, n) else "missing")
    lines.append(f"| `{n}` | {cells[0]} | {cells[1]} | {LIMITS.get('state:' + n, '')} |")
lines += ["", "## Signature differences", "",
          "`tests/unit/test_accelerate_signatures.py` compares the parameters (names, relative order, defaults) of",
          f"{len(signatures._pairs())} callables with Accelerate's: the `impel.utils` names, the Accelerator's and the",
          "state classes' methods, the Accelerator's constructor and `impel.data_loader`. These differences remain:",
          "", "| where | why |", "|---|---|"]
lines += [f"| {k} | {v} |" for k, v in sorted(signatures.ALLOWED.items())]
lines.append("")
out = (sys.argv[1] if len(sys.argv) > 1
       else os.path.join(os.path.dirname(os.path.abspath(__file__)), "accelerate-compatibility.md"))
open(out, "w").write("\n".join(lines))
print(out, "written")
