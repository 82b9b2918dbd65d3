"""ftbridge.log: identity on every line, and a limit on lines that repeat every step."""

from ftbridge.log import RepeatLimit, log_level


def test_a_repeating_line_is_held_back_for_its_interval_and_the_next_one_counts_what_was_held():
    limit = RepeatLimit(every_s=30.0)
    assert limit.allow("ride", 0.0) == 0
    assert [limit.allow("ride", t) for t in (1.0, 2.0, 29.9)] == [None, None, None]
    assert limit.allow("back", 2.0) == 0  # another key has its own interval
    assert limit.allow("ride", 30.0) == 3
    assert limit.allow("ride", 61.0) == 0


def test_group_rank_0_logs_info_the_others_warning_and_the_variable_overrides_both():
    assert (log_level(None, 0), log_level(None, 1), log_level("debug", 1)) == ("INFO", "WARNING", "DEBUG")


def test_torchfts_flight_recorder_warning_is_dropped_only_where_torch_has_no_flight_recorder():
    import logging

    import torch

    from ftbridge.log import _NoFlightRecorderNoise

    def record(msg):
        return logging.LogRecord("torchft.manager", logging.WARNING, __file__, 1, msg, None, None)

    noise = record("[replica_group_0:x/0 - step 3] Unable to reset NCCL flight recorder recording so traces will be "
                   "incorrect.")
    has = hasattr(torch._C._distributed_c10d, "_reset_fr_recording_nccl")
    assert _NoFlightRecorderNoise().filter(noise) is has
    assert _NoFlightRecorderNoise().filter(record("[replica_group_0:x/0 - step 3] got exception in pg configure"))
