"""flexrt.config: DeepSpeed-style configs load, bad ones fail with a message naming the key, the batch triangle
resolves, and to_dict round-trips through JSON."""
import dataclasses, json, re, warnings
import pytest
from flexrt.config import (load_config, FlexConfig, BatchConfig, ZeroConfig, FP16Config, OptimizerConfig, SchedulerConfig,
                           CommsLoggerConfig, CheckpointConfig, AutotuningConfig)

# Three configs in the shape DeepSpeed's docs and tutorials give them.
BERT_FP16_ZERO1 = {  # BERT pre-training style: fp16, Adam, WarmupLR, ZeRO-1
    "train_batch_size": 4096, "train_micro_batch_size_per_gpu": 64, "steps_per_print": 1000,
    "prescale_gradients": False, "gradient_predivide_factor": 1.0, "wall_clock_breakdown": False,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "bias_correction": False}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 1000, "warmup_type": "linear"}},
    "gradient_clipping": 1.0,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
    "zero_optimization": {"stage": 1, "allgather_bucket_size": 5e8, "reduce_bucket_size": 5e8},
}
ZERO3_OFFLOAD_BF16 = {  # ZeRO-Infinity/offload tutorial style, with concrete values where the HF Trainer writes "auto"
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 500, "total_num_steps": 10000}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": 1048576,
        "stage3_prefetch_bucket_size": 943718.4 * 10, "stage3_param_persistence_threshold": 10240,
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": 4, "gradient_clipping": 1.0, "steps_per_print": 2000,
    "train_micro_batch_size_per_gpu": 8, "wall_clock_breakdown": False,
}
TOOLING = {  # profiling, monitoring, checkpoint and autotuning blocks around a ZeRO-2 run
    "train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1,
    "optimizer": {"type": "Lamb", "params": {"lr": 11e-3, "weight_decay": 0.01, "bias_correction": False, "max_coeff": 0.3, "min_coeff": 0.01}},
    "scheduler": {"type": "OneCycle", "params": {"cycle_first_step_size": 1000, "cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_momentum": False}},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_scatter": True, "allgather_partitions": True},
    "fp16": {"enabled": True},
    "progressive_layer_drop": {"enabled": True, "theta": 0.5, "gamma": 0.001},
    "comms_logger": {"enabled": True, "verbose": False, "prof_all": False, "debug": False, "prof_ops": ["all_reduce", "all_gather"]},
    "flops_profiler": {"enabled": True, "profile_step": 1, "module_depth": -1, "top_modules": 1, "detailed": True, "output_file": None},
    "tensorboard": {"enabled": True, "output_path": "logs/", "job_name": "bert_pld"},
    "csv_monitor": {"enabled": False},
    "checkpoint": {"tag_validation": "fail", "load_universal": False, "use_node_local_storage": True},
    "autotuning": {"enabled": True, "fast": False, "metric": "throughput", "tuner_type": "model_based", "tuner_num_trials": 20,
                   "start_profile_step": 3, "end_profile_step": 5, "arg_mappings": {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size"},
                   "model_info": {"num_params": 3.4e8, "hidden_size": 1024, "num_layers": 24}},
    "data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp16", "dataloader_drop_last": True,
}
EXAMPLES = [BERT_FP16_ZERO1, ZERO3_OFFLOAD_BF16, TOOLING]

def test_deepspeed_examples_load_with_their_values():
    bert, zero3, tools = map(load_config, EXAMPLES)
    assert (bert.fp16.enabled, bert.fp16.initial_scale, bert.zero_optimization.stage, bert.optimizer.type) == (True, 65536.0, 1, 'Adam')
    assert bert.zero_optimization.allgather_bucket_size == 500_000_000 and type(bert.zero_optimization.allgather_bucket_size) is int
    assert dataclasses.astuple(bert.resolve_batch(8).batch) == (4096, 64, 8)
    assert (zero3.bf16.enabled, zero3.zero_optimization.offload_param.device, zero3.zero_optimization.offload_optimizer.pin_memory) == (True, 'cpu', True)
    assert zero3.zero_optimization.stage3_prefetch_bucket_size == 9437184
    assert zero3.scheduler.params['total_num_steps'] == 10000
    assert dataclasses.astuple(zero3.resolve_batch(2).batch) == (64, 8, 4)
    assert (tools.optimizer.type, tools.checkpoint.tag_validation, tools.autotuning.tuner_type) == ('Lamb', 'Fail', 'model_based')
    assert tools.autotuning.model_info.num_params == 340_000_000 and tools.comms_logger.prof_ops == ['all_reduce', 'all_gather']
    assert tools.progressive_layer_drop.enabled and tools.tensorboard.job_name == 'bert_pld' and not tools.csv_monitor.enabled

@pytest.mark.parametrize('source', EXAMPLES + [{}, {'train_batch_size': 8, 'zero_optimization': {'stage': 3}}])
def test_to_dict_round_trips_through_json(source):
    c = load_config(source)
    text = json.dumps(c.to_dict())
    assert load_config(json.loads(text)) == c
    assert load_config(c.to_dict()).to_dict() == c.to_dict()
    r = c.resolve_batch(2) if c.batch.train_batch_size or c.batch.train_micro_batch_size_per_gpu else c
    assert load_config(json.loads(json.dumps(r.to_dict()))) == r

def test_json_file_and_dict_give_the_same_config(tmp_path):
    path = tmp_path / 'ds_config.json'
    path.write_text(json.dumps(ZERO3_OFFLOAD_BF16, indent=2))
    c = load_config(path)
    assert c == load_config(str(path)) == load_config(ZERO3_OFFLOAD_BF16)
    assert load_config(c) is c
    (tmp_path / 'broken.json').write_text('{"fp16": {"enabled": true,}}')
    with pytest.raises(ValueError, match='broken.json is not valid JSON'): load_config(tmp_path / 'broken.json')
    with pytest.raises(FileNotFoundError, match='missing.json not found'): load_config(tmp_path / 'missing.json')
    with pytest.raises(TypeError, match='config must be a dict, a JSON file path or a FlexConfig, got list'): load_config([1])
    (tmp_path / 'list.json').write_text('[1, 2]')
    with pytest.raises(TypeError, match='config must be a dict'): load_config(tmp_path / 'list.json')

def test_defaults_are_deepspeeds():
    c = load_config({})
    assert (c.gradient_clipping, c.steps_per_print, c.optimizer, c.scheduler) == (1.0, 10, None, None)
    f = c.fp16
    assert (f.enabled, f.loss_scale, f.initial_scale_power, f.loss_scale_window, f.hysteresis, f.consecutive_hysteresis, f.min_loss_scale) == (False, 0, 16, 1000, 2, False, 1)
    z = c.zero_optimization
    assert (z.stage, z.reduce_bucket_size, z.allgather_bucket_size, z.overlap_comm, z.contiguous_gradients, z.sub_group_size) == (0, 5e8, 5e8, False, True, 1e9)
    assert (z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold, z.stage3_max_live_parameters) == (5e7, 1e5, 1e9)
    assert (z.offload_optimizer.device, z.offload_optimizer.buffer_count, z.offload_param.buffer_count, z.offload_param.buffer_size) == ('none', 4, 5, 1e8)
    assert c.comms_logger == CommsLoggerConfig(enabled=False, verbose=False, prof_all=True, debug=False, prof_ops=[])
    assert (c.progressive_layer_drop.theta, c.progressive_layer_drop.gamma, c.checkpoint.tag_validation) == (0.5, 0.001, 'Warn')
    a = c.autotuning
    assert (a.enabled, a.fast, a.metric, a.tuner_type, a.start_profile_step, a.end_profile_step, a.tuner_early_stopping, a.tuner_num_trials,
            a.max_train_micro_batch_size_per_gpu, a.num_tuning_micro_batch_sizes, a.results_dir) == \
           (False, True, 'throughput', 'gridsearch', 3, 5, 5, 50, 1024, 3, 'autotuning_results')
    assert ZeroConfig(stage=3).overlap_comm is True

# (config, exception, fragment of the message)
BAD = [
    ({'train_batch': 8}, ValueError, "unknown key 'train_batch' at the top level (did you mean 'train_batch_size'?)"),
    ({'batch': {'train_batch_size': 8}}, ValueError, "unknown key 'batch' at the top level"),
    ({'train_batch_size': 0}, ValueError, "train_batch_size must be a positive int, got 0"),
    ({'train_batch_size': 'auto'}, TypeError, "'auto' is a placeholder the Hugging Face Trainer fills in"),
    ({'fp16': {'loss_scale_window': -3}}, ValueError, "fp16.loss_scale_window must be a positive int, got -3"),
    ({'fp16': {'loss_scale_window': 10.5}}, TypeError, "fp16.loss_scale_window must be a positive int, got 10.5"),
    ({'fp16': {'enabled': 'yes'}}, TypeError, "fp16.enabled must be true or false (or 1/0), got 'yes'"),
    ({'fp16': {'hysterisis': 2}}, ValueError, "unknown key 'hysterisis' in fp16 (did you mean 'hysteresis'?)"),
    ({'fp16': {'loss_scale': -1}}, ValueError, "fp16.loss_scale must be a number from 0 to 65504, got -1"),
    ({'fp16': {'enabled': True, 'loss_scale': 1e40}}, ValueError, "fp16.loss_scale must be a number from 0 to 65504, got 1e+40"),
    ({'fp16': {'min_loss_scale': 0}}, ValueError, "fp16.min_loss_scale must be a positive number, got 0"),
    ({'fp16': {'initial_scale_power': 2, 'min_loss_scale': 8}}, ValueError, "fp16.min_loss_scale=8 is above the initial scale 2**2=4"),
    ({'fp16': {'enabled': True}, 'bf16': {'enabled': True}}, ValueError, "fp16.enabled and bf16.enabled are both true; enable one of them"),
    ({'bfloat16': {'enabled': True}, 'bf16': {'enabled': False}}, ValueError, "bfloat16 and bf16 both given; keep only 'bf16'"),
    ({'bf16': True}, TypeError, "bf16 must be a dict (JSON object), got True"),
    ({'gradient_clipping': -0.5}, ValueError, "gradient_clipping must be a non-negative number, got -0.5"),
    ({'gradient_clipping': 'none'}, TypeError, "gradient_clipping must be a non-negative number, got 'none'"),
    ({'gradient_predivide_factor': 0}, ValueError, "gradient_predivide_factor must be a positive number, got 0"),
    ({'steps_per_print': 0}, ValueError, "steps_per_print must be a positive int, got 0"),
    ({'wall_clock_breakdown': 2}, TypeError, "wall_clock_breakdown must be true or false (or 1/0), got 2"),
    ({'zero_allow_untested_optimizer': 'false'}, TypeError, "zero_allow_untested_optimizer must be true or false (or 1/0), got 'false'"),
    ({'communication_data_type': 'fp8'}, ValueError, "communication_data_type must be one of 'fp32', 'fp16', 'bf16' or null, got 'fp8'"),
    ({'optimizer': 'Adam'}, TypeError, "optimizer must be a dict (JSON object) or null, got 'Adam'"),
    ({'optimizer': {'params': {'lr': 0.1}}}, ValueError, "optimizer.type is required"),
    ({'optimizer': {'type': 'Adamw2'}}, ValueError, "optimizer.type 'Adamw2' is not a known optimizer (did you mean 'AdamW'?)"),
    ({'optimizer': {'type': 'OneBitAdam'}}, ValueError, "is a DeepSpeed-only optimizer that flexrt does not provide"),
    ({'optimizer': {'type': 'SGD', 'params': {'momentun': 0.9}}}, ValueError, "unknown key 'momentun' in optimizer.params for SGD (did you mean 'momentum'?)"),
    ({'optimizer': {'type': 'Adam', 'params': 0.1}}, TypeError, "optimizer.params must be a dict (JSON object), got 0.1"),
    ({'optimizer': {'type': 'Adam', 'params': {'lr': -1e-3}}}, ValueError, "optimizer.params.lr must be a non-negative number, got -0.001"),
    ({'optimizer': {'type': 'Adam', 'params': {'lr': 'auto'}}}, TypeError, "optimizer.params.lr must be a non-negative number, got 'auto'"),
    ({'optimizer': {'type': 'Adam', 'params': {'betas': {0.9}}}}, TypeError, "optimizer.params.betas must be JSON data"),
    ({'optimizer': {'type': 'Adam', 'params': {'amsgrad': 'false'}}}, TypeError, "optimizer.params.amsgrad must be true or false (or 1/0), got 'false' (for Adam)"),
    ({'optimizer': {'type': 'AdamW', 'params': {'betas': 0.9}}}, TypeError, "optimizer.params.betas must be a list of 2 numbers, each >= 0 and < 1, got 0.9 (for AdamW)"),
    ({'optimizer': {'type': 'Adam', 'params': {'betas': [0.9, 1.5]}}}, ValueError, "optimizer.params.betas[1] must be a number >= 0 and < 1, got 1.5 (for Adam)"),
    ({'optimizer': {'type': 'Adam', 'params': {'betas': [0.9, 0.99, 0.999]}}}, TypeError, "optimizer.params.betas must be a list of 2 numbers, each >= 0 and < 1, got [0.9, 0.99, 0.999]"),
    ({'optimizer': {'type': 'Lamb', 'params': {'betas': [-0.1, 0.9]}}}, ValueError, "optimizer.params.betas[0] must be a number >= 0 and < 1, got -0.1 (for Lamb)"),
    ({'optimizer': {'type': 'SGD', 'params': {'lr': 0.1, 'nesterov': 'yes'}}}, TypeError, "optimizer.params.nesterov must be true or false (or 1/0), got 'yes' (for SGD)"),
    ({'optimizer': {'type': 'Adam', 'params': {'eps': -1e-8}}}, ValueError, "optimizer.params.eps must be a non-negative number, got -1e-08 (for Adam)"),
    ({'optimizer': {'type': 'Adam', 'parms': {}}}, ValueError, "unknown key 'parms' in optimizer (did you mean 'params'?)"),
    ({'scheduler': {'type': 'WarmupCosine'}}, ValueError, "scheduler.type 'WarmupCosine' is not a known schedule (did you mean 'WarmupCosineLR'?)"),
    ({'scheduler': {'type': 'WarmupDecayLR', 'params': {'warmup_num_steps': 10}}}, ValueError, "scheduler.params.total_num_steps is required by WarmupDecayLR"),
    ({'scheduler': {'type': 'WarmupLR', 'params': {'warmup_max': 1e-3}}}, ValueError, "unknown key 'warmup_max' in scheduler.params for WarmupLR (did you mean 'warmup_max_lr'?)"),
    ({'scheduler': {'type': 'WarmupLR', 'params': {'warmup_type': 'cosine'}}}, ValueError, "scheduler.params.warmup_type must be one of 'log', 'linear', got 'cosine'"),
    ({'scheduler': {'type': 'StepLR', 'params': {'gamma': 0.5}}}, ValueError, "scheduler.params.step_size is required by StepLR"),
    ({'scheduler': {'type': 'StepLR', 'params': {'step_size': 0}}}, ValueError, "scheduler.params.step_size must be a positive int, got 0 (for StepLR)"),
    ({'scheduler': {'type': 'StepLR', 'params': {'step_size': 2.5}}}, TypeError, "scheduler.params.step_size must be a positive int, got 2.5 (for StepLR)"),
    ({'scheduler': {'type': 'CosineAnnealingLR', 'params': {'T_max': 0}}}, ValueError, "scheduler.params.T_max must be a positive int, got 0 (for CosineAnnealingLR)"),
    ({'zero_optimization': 2}, TypeError, "zero_optimization must be a dict (JSON object), got 2"),
    ({'zero_optimization': {'stage': 4}}, ValueError, "zero_optimization.stage must be an int from 0 to 3, got 4"),
    ({'zero_optimization': {'stage': '2'}}, TypeError, "zero_optimization.stage must be an int from 0 to 3, got '2'"),
    ({'zero_optimization': {'stgae': 2}}, ValueError, "unknown key 'stgae' in zero_optimization (did you mean 'stage'?)"),
    ({'zero_optimization': {'reduce_bucket_size': 2.5}}, TypeError, "zero_optimization.reduce_bucket_size must be a positive int, got 2.5"),
    ({'zero_optimization': {'reduce_bucket_size': 0}}, ValueError, "zero_optimization.reduce_bucket_size must be a positive int, got 0"),
    ({'zero_optimization': {'stage': 3, 'stage3_prefetch_bucket': 5e7}}, ValueError, "did you mean 'stage3_prefetch_bucket_size'?"),
    ({'zero_optimization': {'stage': 3, 'offload_param': {'device': 'gpu'}}}, ValueError,
     "zero_optimization.offload_param.device must be one of 'none', 'cpu', 'nvme', got 'gpu'"),
    ({'zero_optimization': {'stage': 3, 'offload_optimizer': {'device': 'nvme'}}}, ValueError,
     "zero_optimization.offload_optimizer.device is 'nvme' but zero_optimization.offload_optimizer.nvme_path is not set"),
    ({'zero_optimization': {'stage': 3, 'offload_optimizer': {'device': 'cpu', 'pin_memroy': True}}}, ValueError,
     "unknown key 'pin_memroy' in zero_optimization.offload_optimizer (did you mean 'pin_memory'?)"),
    ({'zero_optimization': {'stage': 3, 'offload_optimizer': {'device': 'cpu', 'ratio': 1.5}}}, ValueError,
     "zero_optimization.offload_optimizer.ratio must be a number from 0 to 1, got 1.5"),
    ({'comms_logger': {'enable': True}}, ValueError, "unknown key 'enable' in comms_logger (did you mean 'enabled'?)"),
    ({'comms_logger': {'prof_ops': 'all_reduce'}}, TypeError, "comms_logger.prof_ops must be a list of strings, got 'all_reduce'"),
    ({'progressive_layer_drop': {'theta': 1.5}}, ValueError, "progressive_layer_drop.theta must be a number above 0 and at most 1, got 1.5"),
    ({'progressive_layer_drop': {'gamma': -0.1}}, ValueError, "progressive_layer_drop.gamma must be a positive number, got -0.1"),
    ({'checkpoint': {'tag_validation': 'strict'}}, ValueError, "checkpoint.tag_validation must be one of 'Ignore', 'Warn', 'Fail', got 'strict'"),
    ({'checkpoint': {'parallel_write': {'stage': True}}}, ValueError, "unknown key 'stage' in checkpoint.parallel_write (valid: pipeline_stage)"),
    ({'autotuning': {'metric': 'speed'}}, ValueError, "autotuning.metric must be one of 'throughput', 'latency', 'flops', got 'speed'"),
    ({'autotuning': {'tuner_type': 'bayes'}}, ValueError, "autotuning.tuner_type must be one of 'gridsearch', 'random', 'model_based', 'tpe', 'gp', 'grid', got 'bayes'"),
    ({'autotuning': {'start_profile_step': 6}}, ValueError, "autotuning.start_profile_step=6 must be below autotuning.end_profile_step=5"),
    ({'autotuning': {'model_info': {'num_layer': 2}}}, ValueError, "unknown key 'num_layer' in autotuning.model_info (did you mean 'num_layers'?)"),
    ({'autotuning': {'arg_mappings': {'train_micro_batch_size_per_gpu': 1}}}, TypeError,
     "autotuning.arg_mappings.train_micro_batch_size_per_gpu must be a string, got 1"),
    ({'data_types': {'grad_accum_dtype': 'int8'}}, ValueError, "data_types.grad_accum_dtype must be one of 'fp32', 'fp16', 'bf16' or null, got 'int8'"),
    ({'flops_profiler': {'profile_step': 0}}, ValueError, "flops_profiler.profile_step must be a positive int, got 0"),
    ({'tensorboard': {'enabled': True, 'output_path': 3}}, TypeError, "tensorboard.output_path must be a string, got 3"),
    ({'amps': {'enabled': True}}, ValueError, "unknown key 'amps' at the top level"),
]

@pytest.mark.parametrize('config,error,fragment', BAD, ids=[repr(c)[:60] for c, _, _ in BAD])
def test_bad_config_names_the_key(config, error, fragment):
    with pytest.raises(error, match=re.escape(fragment)):
        load_config(config)

@pytest.mark.parametrize('zero', [{'stage': 1, 'offload_param': {'device': 'cpu'}}, {'offload_optimizer': {'device': 'cpu'}}])
def test_offload_below_its_stage_has_no_effect(zero):
    "As in DeepSpeed, which ignores them there: parameter offload below stage 3, optimizer offload at stage 0 (warned, kept)"
    from flexrt.config import NoEffectWarning
    with pytest.warns(NoEffectWarning, match='has no effect at stage'): c = load_config({'zero_optimization': zero})
    assert c.zero_optimization.stage == zero.get('stage', 0)

# Batch triangle: (dp world size, given keys, expected (train, micro, accumulation)).
TRIANGLE = [
    (2, dict(train_batch_size=32, train_micro_batch_size_per_gpu=8), (32, 8, 2)),
    (2, dict(train_batch_size=32, gradient_accumulation_steps=4), (32, 4, 4)),
    (2, dict(train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=2), (32, 8, 2)),
    (4, dict(train_batch_size=32), (32, 8, 1)),
    (4, dict(train_micro_batch_size_per_gpu=3), (12, 3, 1)),
    (1, dict(train_batch_size=6, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=3), (6, 2, 3)),
    (3, dict(train_batch_size=18, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=3), (18, 2, 3)),
]

@pytest.mark.parametrize('world,given,expected', TRIANGLE)
def test_batch_triangle_derives_the_missing_sizes(world, given, expected):
    r = load_config(given).resolve_batch(world)
    assert dataclasses.astuple(r.batch) == expected
    tb, mb, gas = expected
    assert tb == mb * gas * world
    assert load_config(r.to_dict()).resolve_batch(world) == r

TRIANGLE_BAD = [
    (2, dict(train_batch_size=33, train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=2),
     "train_batch_size=33 is not micro (8) x accumulation (2) x world (2) = 32"),
    (4, dict(train_batch_size=32, train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=2),
     "train_batch_size=32 is not micro (8) x accumulation (2) x world (4) = 64"),
    (4, dict(train_batch_size=8, train_micro_batch_size_per_gpu=4), "train_batch_size=8 is not a multiple of micro (4) x world (4) = 16"),
    (2, dict(train_batch_size=30, gradient_accumulation_steps=4), "train_batch_size=30 is not a multiple of accumulation (4) x world (2) = 8"),
    (3, dict(train_batch_size=8), "train_batch_size=8 is not a multiple of accumulation (1) x world (3) = 3"),
    (2, dict(gradient_accumulation_steps=2), "give train_batch_size or train_micro_batch_size_per_gpu"),
    (2, dict(), "give train_batch_size or train_micro_batch_size_per_gpu"),
    (0, dict(train_batch_size=8), "dp_world_size must be a positive int, got 0"),
]

@pytest.mark.parametrize('world,given,fragment', TRIANGLE_BAD)
def test_batch_triangle_errors_show_the_arithmetic(world, given, fragment):
    c = load_config(given)
    with pytest.raises(ValueError, match=re.escape(fragment)):
        c.resolve_batch(world)

def test_resolve_returns_a_copy():
    c = load_config({'train_batch_size': 16})
    r = c.resolve_batch(2)
    assert c.batch == BatchConfig(train_batch_size=16) and r.batch == BatchConfig(train_batch_size=16, train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=1)
    assert dataclasses.replace(r, batch=c.batch) == c

def test_blocks_are_frozen_and_replace_validates_again():
    c = load_config(BERT_FP16_ZERO1)
    with pytest.raises(dataclasses.FrozenInstanceError): c.fp16.enabled = False
    z = dataclasses.replace(c.zero_optimization, stage=3, overlap_comm=None)
    assert (z.stage, z.overlap_comm) == (3, True)
    with pytest.raises(ValueError, match=re.escape('zero_optimization.stage must be an int from 0 to 3, got 5')):
        dataclasses.replace(c.zero_optimization, stage=5)
    with pytest.raises(ValueError, match='enable one of them'):
        dataclasses.replace(c, bf16=dataclasses.replace(c.bf16, enabled=True))

def test_names_are_normalised():
    c = load_config({'optimizer': {'type': 'adamw'}, 'scheduler': {'type': 'warmupcosinelr', 'params': {'total_num_steps': 10}},
                     'checkpoint': {'tag_validation': 'IGNORE'}, 'zero_optimization': {'stage': 3, 'offload_param': {'device': 'CPU'}},
                     'autotuning': {'metric': 'Latency'}})
    assert (c.optimizer.type, c.scheduler.type, c.checkpoint.tag_validation, c.zero_optimization.offload_param.device, c.autotuning.metric) == \
           ('AdamW', 'WarmupCosineLR', 'Ignore', 'cpu', 'latency')
    assert load_config({'optimizer': {'type': 'SGD', 'params': {'lr': 0.1, 'momentum': 0.9, 'nesterov': True}}}).optimizer.params['nesterov'] is True
    assert load_config({'scheduler': {'type': 'StepLR', 'params': {'step_size': 10, 'gamma': 0.5}}}).scheduler.type == 'StepLR'

def test_legacy_keys_are_accepted_with_a_warning():
    with pytest.warns(DeprecationWarning, match="bfloat16 is deprecated; use bf16"):
        assert load_config({'bfloat16': {'enabled': True}}).bf16.enabled
    with pytest.warns(DeprecationWarning, match='cpu_offload is deprecated'):
        z = load_config({'zero_optimization': {'stage': 2, 'cpu_offload': True, 'cpu_offload_use_pin_memory': True}}).zero_optimization
    assert (z.offload_optimizer.device, z.offload_optimizer.pin_memory) == ('cpu', True)
    with pytest.warns(DeprecationWarning, match='use zero_optimization.stage3_gather_16bit_weights_on_model_save'):
        z = load_config({'zero_optimization': {'stage': 3, 'stage3_gather_fp16_weights_on_model_save': True}}).zero_optimization
    assert z.stage3_gather_16bit_weights_on_model_save

def test_comms_logger_block_off_means_off_and_feeds_flexrt_comm():
    from flexrt.comm import comms_config
    assert load_config({'comms_logger': {'enabled': False}}).comms_logger.enabled is False
    c = load_config({'comms_logger': {'enabled': True, 'prof_all': False, 'prof_ops': ['all_reduce']}})
    got = comms_config(c)
    assert (got.enabled, got.prof_all, got.prof_ops) == (True, False, ['all_reduce'])

@pytest.mark.parametrize('source', EXAMPLES)
def test_configs_survive_pickle_and_deepcopy(source):
    "notebook_launcher and the autotuner ship configs to other processes and copy them"
    import copy, pickle
    c = load_config(source)
    assert pickle.loads(pickle.dumps(c)) == c and copy.deepcopy(c) == c

def test_deepspeed_leniency_is_kept():
    "Values DeepSpeed takes and its users rely on load: flags as 1/0, null warmup steps, integral floats for sizes"
    c = load_config({'train_batch_size': 8, 'zero_allow_untested_optimizer': 1, 'fp16': {'enabled': 0},
                     'optimizer': {'type': 'Adam', 'params': {'lr': 1, 'amsgrad': 0, 'torch_adam': 1}},
                     'scheduler': {'type': 'WarmupLR', 'params': {'warmup_num_steps': None}}})
    assert (c.zero_allow_untested_optimizer, c.fp16.enabled) == (True, False)
    assert c.optimizer.params == {'lr': 1, 'amsgrad': False, 'torch_adam': True}
    assert c.scheduler.params == {'warmup_num_steps': None}
    assert load_config({'train_batch_size': 8, 'scheduler': {'type': 'StepLR', 'params': {'step_size': 1e3}}}).scheduler.params['step_size'] == 1000

def test_huge_bucket_sizes_are_clamped_with_a_warning():
    from flexrt.config.blocks import MAX_BUCKET_SIZE
    with pytest.warns(UserWarning, match=r"zero_optimization.reduce_bucket_size=1e\+15 is more than any device holds; using 1099511627776"):
        c = load_config({'train_batch_size': 8, 'zero_optimization': {'stage': 2, 'reduce_bucket_size': 1e15}})
    assert c.zero_optimization.reduce_bucket_size == MAX_BUCKET_SIZE
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert load_config(c.to_dict()) == c   # the clamped value round-trips silently

def test_a_json_file_with_a_duplicate_key_is_refused(tmp_path):
    path = tmp_path / 'ds.json'
    path.write_text('{"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 0.001, "lr": 0.1}}}')
    with pytest.raises(ValueError, match=re.escape("the key optimizer.params.lr is given twice (0.001 and 0.1)")): load_config(path)
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ValueError, match=re.escape("the key train_batch_size is given twice (8 and 16)")): load_config(path)

def test_the_step_anatomy_block_loads_round_trips_and_names_its_errors():
    "diagnostics.anatomy (flexrt's own): whether step records carry the anatomy, and its CUDA event sampling"
    from flexrt.config.blocks import AnatomyConfig
    c = load_config({'train_batch_size': 8, 'diagnostics': {'anatomy': {'enabled': True, 'cuda_every': 10}}})
    assert c.diagnostics.anatomy == AnatomyConfig(enabled=True, cuda_every=10)
    assert c.to_dict()['diagnostics']['anatomy'] == {'enabled': True, 'cuda_every': 10} and load_config(c.to_dict()) == c
    assert load_config({'train_batch_size': 8}).diagnostics.anatomy == AnatomyConfig(enabled=None, cuda_every=0)
    for anatomy, error, fragment in (
            ({'cuda_every': -1}, ValueError, 'diagnostics.anatomy.cuda_every must be a non-negative int, got -1'),
            ({'cuda_every': 'often'}, TypeError, "diagnostics.anatomy.cuda_every must be a non-negative int, got 'often'"),
            ({'enabled': 'yes'}, TypeError, 'diagnostics.anatomy.enabled must be'),
            ({'cuda_evry': 10}, ValueError, "unknown key 'cuda_evry' in diagnostics.anatomy (did you mean 'cuda_every'?)"),
            ({'enabled': False, 'cuda_every': 10}, ValueError,
             'enabled=false turns off: set enabled to true (or null), or cuda_every to 0')):
        with pytest.raises(error, match=re.escape(fragment)):
            load_config({'train_batch_size': 8, 'diagnostics': {'anatomy': anatomy}})
