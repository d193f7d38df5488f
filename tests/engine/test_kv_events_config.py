"""--kv-events-config field checks: each bad value is refused when the config is read, naming
its key, instead of killing the publisher thread later."""

import pytest

from kvtier.engine.kv_events import KVEventsConfig, KVEventsConfigError


@pytest.mark.parametrize("text, message", [
    ('{"endpoint": 5}', "kv_events_config.endpoint must be a string, got 5"),
    ('{"buffer_steps": "x"}',
     "kv_events_config.buffer_steps must be an integer in [1, 2147483647], got 'x'"),
    ('{"enable_kv_cache_events": "yes", "topic": 5}',
     "kv_events_config.enable_kv_cache_events must be true or false, got 'yes'"),
    ('{"enable_kv_cache_events": true, "topic": 5}',
     "kv_events_config.topic must be a string, got 5"),
    ('{"hwm": 1.5}', "kv_events_config.hwm must be an integer in [1, 2147483647], got 1.5"),
    ('{"hwm": 2147483648}',
     "kv_events_config.hwm must be an integer in [1, 2147483647], got 2147483648"),
    ('{"max_queue_size": true}',
     "kv_events_config.max_queue_size must be an integer in [1, 2147483647], got True"),
    ('{"max_queue_size": 0}',
     "kv_events_config.max_queue_size must be an integer in [1, 2147483647], got 0"),
    ('{"publisher": 1}', "kv_events_config.publisher must be a string or null, got 1"),
    ('{"replay_endpoint": []}', "kv_events_config.replay_endpoint must be a string or null, "
                                "got []"),
    ('{"include_token_ids": 0}', "kv_events_config.include_token_ids must be true or false, "
                                 "got 0"),
])
def test_each_field_type_and_range_is_checked_naming_the_key(text, message):
    with pytest.raises(KVEventsConfigError) as info:
        KVEventsConfig.from_json(text)
    assert str(info.value) == message


def test_good_values_and_nulls_pass():
    config = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": null, '
                                      '"replay_endpoint": null, "hwm": 1, "topic": "t"}')
    assert (config.publisher, config.hwm, config.topic) == ("zmq", 1, "t")
