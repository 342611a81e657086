"""Bad inputs to `impel launch`, shared by the CLI tests and the reliability table (docs/reliability.md).

Each entry: name -> (the input, fragments the one-paragraph error must contain).
"""
from __future__ import annotations

BAD_FILES = {
    "unknown_key": ("mixed_precison: bf16\n",
                    ["unknown config key 'mixed_precison'", "did you mean 'mixed_precision'"]),
    "unknown_section_key": ("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_stratgy: FULL_SHARD\n",
                            ["unknown fsdp_config key 'fsdp_sharding_stratgy'", "'fsdp_sharding_strategy'"]),
    "wrong_type": ("num_processes: two\n", ["num_processes='two' must be an integer"]),
    "bad_choice": ("mixed_precision: fp32\n", ["mixed_precision='fp32' is not allowed", "'no', 'fp16', 'bf16'"]),
    "bad_section_choice": ("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: EVERYTHING\n",
                           ["fsdp_sharding_strategy='EVERYTHING' is not allowed", "'FULL_SHARD'"]),
    "bad_zero_stage": ("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 4\n",
                       ["zero_stage=4 is not a DeepSpeed ZeRO stage; use 0, 1, 2 or 3"]),
    "both_strategies": ("distributed_type: FSDP\ndeepspeed_config:\n  zero_stage: 3\n",
                        ["deepspeed_config is set but distributed_type='FSDP'"]),
    "not_yaml": ("mixed_precision: [bf16\n", ["is not valid YAML at line", "fix the syntax"]),
    "not_a_mapping": ("- mixed_precision\n- bf16\n", ["must hold a mapping of keys to values, not a list"]),
    "tpu_setting_on": ("downcast_bf16: 'yes'\n", ["downcast_bf16='yes' is a TPU setting", "remove the key"]),
    "orig_params_off": ("distributed_type: FSDP\nfsdp_config:\n  fsdp_use_orig_params: false\n",
                        ["fsdp_use_orig_params=false has no FSDP2 equivalent"]),
    "duplicate_key": ("num_processes: 2\nmixed_precision: bf16\nnum_processes: 4\n",
                      ["sets 'num_processes' twice (line 1 and line 3); keep one"]),
    "mesh_product": ("num_processes: 4\nuse_cpu: true\nparallelism_config:\n  parallelism_config_tp_size: 3\n",
                     ["tp_size=3, cp_size=1, sp_size=1 multiply to 3, but num_processes=4"]),
}

BAD_FLAGS = {
    "zero_processes": (["--num_processes", "0"], ["--num_processes=0 must be an integer >= 1"]),
    "fsdp_and_deepspeed": (["--use_fsdp", "--use_deepspeed"], ["--use_fsdp and --use_deepspeed were both given"]),
    "bad_flag_choice": (["--mixed_precision", "fp8"], ["--mixed_precision='fp8' is not allowed"]),
    "bad_bool": (["--cpu=maybe"], ["--cpu='maybe' must be true or false"]),
    "flag_for_absent_strategy": (["--fsdp_sharding_strategy", "FULL_SHARD"],
                                 ["fsdp_config is set but distributed_type=None", "--use_fsdp"]),
    "uneven_machines": (["--num_processes", "3", "--num_machines", "2", "--main_process_ip", "127.0.0.1"],
                        ["num_processes=3 is not a multiple of num_machines=2"]),
    "machines_without_ip": (["--num_machines", "2"], ["needs main_process_ip"]),
    "cpu_and_multi_gpu": (["--cpu", "--multi_gpu"], ["use_cpu=true contradicts distributed_type='MULTI_GPU'"]),
    "tp_under_replication": (["--num_processes", "4", "--parallelism_config_dp_replicate_size", "2",
                              "--parallelism_config_tp_size", "2"],
                             ["dp_replicate_size=2 with dp_shard_size=1 and tp_size=2", "set dp_shard_size=2"]),
    "config_file_is_a_directory": (["--config_file", "."], ["config file '.' is a directory, not a file",
                                                            "pass the YAML file itself"]),
    "missing_config_file": (["--config_file", "nowhere.yaml"], ["config file 'nowhere.yaml' does not exist",
                                                                 "impel config"]),
    # issue 27: checked before any rank starts (torch printed a traceback after 16 s, or retried for ever)
    "port_out_of_range": (["--cpu", "--num_processes", "2", "--main_process_port", "99999"],
                          ["--main_process_port=99999 must be an integer from 1 to 65535"]),
    "unknown_main_host": (["--cpu", "--num_processes", "2", "--num_machines", "2", "--main_process_ip",
                           "no-such-host.invalid"],
                          ["--main_process_ip no-such-host.invalid", "resolve", "pass the IP address"]),
    "unknown_main_host_other_machine": (["--cpu", "--num_processes", "2", "--num_machines", "2", "--machine_rank",
                                         "1", "--main_process_ip", "no-such-host.invalid"],
                                        ["--main_process_ip no-such-host.invalid", "resolve"]),
    "bad_stall_warning": (["--cpu", "--num_processes", "2", "--stall_warning", "soon"],
                          ["--stall_warning='soon' must be a number of seconds >= 0"]),
    "stall_warning_on_one_process": (["--cpu", "--stall_warning", "5"],
                                     ["--stall_warning has no effect on one process"]),
    # elastic jobs (--nnodes MIN:MAX)
    "nnodes_not_a_range": (["--cpu", "--nnodes", "1-2"], ["--nnodes '1-2' must be N or MIN:MAX"]),
    "nnodes_min_above_max": (["--cpu", "--nnodes", "3:2", "--main_process_ip", "127.0.0.1"],
                             ["min_machines=3 is above num_machines=2"]),
    "nnodes_contradicts_num_machines": (["--cpu", "--nnodes", "1:2", "--num_machines", "3"],
                                        ["--nnodes 1:2 contradicts --num_machines 3"]),
    "node_rank_contradicts_machine_rank": (["--cpu", "--node_rank", "1", "--machine_rank", "0"],
                                           ["--node_rank 1 contradicts --machine_rank 0"]),
    "elastic_without_restarts": (["--cpu", "--nnodes", "1:2", "--main_process_ip", "127.0.0.1"],
                                 ["restarting its ranks from the last checkpoint: set --max_restarts N"]),
    "elastic_batch_not_kept": (["--cpu", "--nnodes", "2:3", "--main_process_ip", "127.0.0.1", "--max_restarts", "3"],
                               ["gradient_accumulation_steps=1 cannot keep the global batch when the job planned "
                                "for 3 machines runs on 2", "a multiple of 2"]),
    "elastic_static_rendezvous": (["--cpu", "--nnodes", "1:2", "--main_process_ip", "127.0.0.1", "--rdzv_backend",
                                   "static", "--max_restarts", "3"], ["needs the c10d rendezvous"]),
    "elastic_deepspeed": (["--use_deepspeed", "--nnodes", "1:2", "--main_process_ip", "127.0.0.1",
                           "--max_restarts", "3"], ["(elastic) is not supported with DeepSpeed"]),
    # issue 36: a range no accumulation keeps (a traceback, or a hang for 1:3000000), and launcher values that torch
    # failed on with a traceback or passed on unchecked
    "nnodes_range_too_wide": (["--cpu", "--max_restarts", "1", "--main_process_ip", "127.0.0.1", "--nnodes",
                               "1:100000"], ["--nnodes 1:100000: no gradient_accumulation_steps up to 1000000",
                                             "raise MIN closer to MAX"]),
    "nnodes_range_huge": (["--cpu", "--max_restarts", "1", "--main_process_ip", "127.0.0.1", "--nnodes",
                           "1:3000000"], ["--nnodes 1:3000000: no gradient_accumulation_steps"]),
    "gpu_ids_not_ids": (["--gpu_ids", "abc"], ["gpu_ids='abc' must be 'all' or GPU ids separated by commas"]),
    "monitor_interval_zero": (["--cpu", "--num_processes", "2", "--monitor_interval", "0"],
                              ["monitor_interval=0.0 must be a number of seconds above 0"]),
    "rdzv_conf_not_pairs": (["--cpu", "--num_processes", "2", "--rdzv_conf", "garbage"],
                            ["--rdzv_conf 'garbage' must be KEY=VALUE pairs separated by commas"]),
    "no_python_of_a_python_file": (["--no_python"], ["--no_python runs", "as a program", "drop --no_python"]),
    "main_process_ip_with_port": (["--cpu", "--num_processes", "2", "--main_process_ip", "127.0.0.1:29500"],
                                  ["main_process_ip='127.0.0.1:29500' includes a port",
                                   "--main_process_ip 127.0.0.1 --main_process_port 29500"]),
}

# `impel config validate` / `impel config convert --to fsdp` of DS_YAML, whose DeepSpeed JSON (ds.json) is missing
# (None), broken, or contradicts itself or the YAML: name -> (ds.json's text, fragments of the one-line error)
DS_YAML = ("distributed_type: DEEPSPEED\nnum_processes: 2\ngradient_accumulation_steps: 4\ndeepspeed_config:\n"
           "  deepspeed_config_file: ds.json\n")
BAD_DEEPSPEED_JSON = {
    "missing": (None, ["deepspeed_config_file='ds.json' does not exist or is not a file"]),
    "broken": ('{"zero_optimization": {', ["deepspeed_config_file='ds.json' is not valid JSON (Expecting property",
                                           "fix the file"]),
    "bf16_and_fp16": ('{"bf16": {"enabled": true}, "fp16": {"enabled": true}}',
                      ["the DeepSpeed JSON 'ds.json' enables both bf16 and fp16; enable at most one"]),
    "batch_product": ('{"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}',
                      ["train_batch_size=7 in the DeepSpeed JSON 'ds.json' is not train_micro_batch_size_per_gpu * "
                       "gradient_accumulation_steps * world size (2 * 4 * 2 = 16)"]),
    "batch_not_divisible": ('{"train_batch_size": 6}', ["train_batch_size=6 in the DeepSpeed JSON 'ds.json' is not "
                                                        "a multiple of gradient_accumulation_steps=4 * world size 2 "
                                                        "(= 8)"]),
    "duplicate_key": ('{"zero_optimization": {"stage": 2, "stage": 3}}',
                      ["deepspeed_config_file='ds.json' sets 'stage' twice in one object; keep one"]),
    # issue 36: values DeepSpeed failed on later with a traceback, or not at all
    "micro_batch_negative": ('{"train_micro_batch_size_per_gpu": -1}',
                             ["train_micro_batch_size_per_gpu=-1 in the DeepSpeed JSON 'ds.json' must be a whole "
                              "number >= 1"]),
    "clipping_not_a_number": ('{"gradient_clipping": "big"}',
                              ["gradient_clipping='big' in the DeepSpeed JSON 'ds.json' must be a number >= 0"]),
    "offload_device_unknown": ('{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu9"}}}',
                               ["zero_optimization.offload_optimizer.device='gpu9'", "none, cpu, nvme"]),
    "accumulation": ('{"gradient_accumulation_steps": 1}',
                     ["gradient_accumulation_steps=4 contradicts gradient_accumulation_steps=1 in the DeepSpeed JSON "
                      "'ds.json'"]),
}
