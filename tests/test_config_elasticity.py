"""DeepSpeed's `elasticity` block as a config block: `load_config` takes it (dict, JSON file, FlexConfig), refuses bad
values naming the key, refuses the batch keys beside an enabled block, and `flexrt.initialize` reads it from the
loaded config (the batch sizes it gives at the run's world size; the `'elasticity'` record)."""
import json
import pytest, torch
from flexrt import monitor
from flexrt.config import load_config, ElasticityConfig

SMALL = {'enabled': True, 'max_train_batch_size': 24, 'micro_batch_sizes': [2, 4], 'min_gpus': 1, 'max_gpus': 4}
SGD = {'type': 'SGD', 'params': {'lr': 0.1}}


def test_load_config_takes_the_block_from_a_dict_and_a_json_file(tmp_path):
    c = load_config({'elasticity': SMALL, 'optimizer': SGD})
    assert isinstance(c.elasticity, ElasticityConfig)
    block = c.elasticity
    assert (block.enabled, block.max_train_batch_size, block.micro_batch_sizes) == (True, 24, [2, 4])
    assert (block.version, block.prefer_larger_batch, block.num_gpus_per_node) == (0.2, True, 1)
    assert c.batch.train_batch_size is None          # the block sets it once the world size is known
    path = tmp_path / 'ds.json'
    path.write_text(json.dumps({'elasticity': SMALL, 'optimizer': SGD}))
    assert load_config(path) == c
    assert load_config(json.loads(json.dumps(c.to_dict()))) == c
    assert load_config({}).elasticity == ElasticityConfig() and not load_config({}).elasticity.enabled


@pytest.mark.parametrize('block,fragment', [
    ({'max_gpu': 4}, "unknown key 'max_gpu' in elasticity (did you mean 'max_gpus'?)"),
    ({'enabled': 'yes'}, "elasticity.enabled must be true or false (or 1/0), got 'yes'"),
    ({'min_gpus': 0}, 'elasticity.min_gpus must be a positive int, got 0'),
    ({'max_train_batch_size': -8}, 'elasticity.max_train_batch_size must be a positive int, got -8'),
    ({'micro_batch_sizes': 4}, 'elasticity.micro_batch_sizes must be a list of ints or null, got 4'),
    ({'micro_batch_sizes': [2, 0]}, 'elasticity.micro_batch_sizes must be a non-empty list of positive ints'),
    ({'version': 0.3}, 'elasticity.version must be 0.1 or 0.2, got 0.3'),
    ({'min_time': -1}, 'elasticity.min_time must be a non-negative int, got -1'),
    ({'enabled': True, 'micro_batch_sizes': [2]}, 'elasticity.max_train_batch_size is required when'),
    ({'enabled': True, 'max_train_batch_size': 8}, 'elasticity.micro_batch_sizes is required when elasticity.enabled'),
    ({**SMALL, 'micro_batch_sizes': [32]}, 'elasticity.micro_batch_sizes [32] has one above max_train_batch_size=24'),
    ({**SMALL, 'min_gpus': 8}, 'elasticity.min_gpus=8 is above max_gpus=4'),
    ({**SMALL, 'num_gpus_per_node': 4, 'model_parallel_size': 3}, 'num_gpus_per_node=4 does not divide by'),
    ({**SMALL, 'version': 0.1, 'model_parallel_size': 2, 'num_gpus_per_node': 2}, 'version 0.1 has no model parallel'),
])
def test_a_bad_value_is_refused_naming_the_key(block, fragment):
    with pytest.raises((TypeError, ValueError)) as e:
        load_config({'elasticity': block})
    assert fragment in str(e.value)


def test_batch_keys_beside_an_enabled_block_are_refused_unless_ignored():
    with pytest.raises(ValueError, match='train_batch_size, gradient_accumulation_steps given beside an enabled '
                                         'elasticity block.*ignore_non_elastic_batch_info to true'):
        load_config({'elasticity': SMALL, 'train_batch_size': 8, 'gradient_accumulation_steps': 2})
    assert load_config({'elasticity': {**SMALL, 'enabled': False}, 'train_batch_size': 8}).batch.train_batch_size == 8
    ignored = load_config({'elasticity': {**SMALL, 'ignore_non_elastic_batch_info': True}, 'train_batch_size': 8})
    assert ignored.batch.train_batch_size == 8


def test_initialize_reads_the_block_from_the_loaded_config():
    import flexrt
    records, model = [], torch.nn.Linear(2, 2)
    given = load_config({'elasticity': {**SMALL, 'ignore_non_elastic_batch_info': True}, 'train_batch_size': 8,
                         'optimizer': SGD})
    with monitor.listen(records.append):
        engine, *_ = flexrt.initialize(model=model, config=given, dist_init_required=False)
    try:
        # one rank: the block's global batch of 24, its largest micro-batch that divides it, the config's 8 ignored
        assert engine.get_batch_info() == (24, 4, 6)
        assert engine.config.elasticity.max_train_batch_size == 24
        assert load_config(engine.config.to_dict()) == engine.config     # what a checkpoint records loads again
    finally:
        engine.close()
    record = next(r for r in records if r['kind'] == 'elasticity')
    assert (record['train_batch_size'], record['world_sizes'], record['strict']) == (24, [1, 2, 3, 4], False)
