"""The interleaved hand-off comparison reads each process's per-step p50s from stderr, where the
producer's and the consumer's lines may run into one another."""

from bench.handoff_ab import parse_steps, step_medians


def test_steps_are_read_per_process_even_when_two_lines_run_together():
    stderr = ("ipcpool: 1,050 of 1,050 in 6.9 s\n"
              "  producer step p50: create 55.5 µs, seal 59.9 µs"
              "  consumer step p50: start->got lease 252.2 µs, read 30.3 µs\n\n")
    assert parse_steps(stderr) == {"producer create": 55.5, "producer seal": 59.9,
                                   "consumer start->got lease": 252.2, "consumer read": 30.3}


def test_steps_are_read_with_their_means_where_printed():
    stderr = ("  producer step p50 (mean): create 9.5 (12.25) µs, create+view+seal 24.0 (30.5) µs\n"
              "  consumer step p50 (mean): get once sealed 14.1 (15.0) µs\n")
    assert parse_steps(stderr) == {"producer create": 9.5, "producer create (mean)": 12.25,
                                   "producer create+view+seal": 24.0, "producer create+view+seal (mean)": 30.5,
                                   "consumer get once sealed": 14.1, "consumer get once sealed (mean)": 15.0}


def test_the_reports_after_a_step_line_are_not_steps():
    stderr = ("  consumer step p50 (mean): get once sealed 14.1 (15.0) µs\n"
              "  consumer: 2 of 1045 hand-offs waited past the reader's spin (it asked the broker to wake it), "
              "p50 465.9 µs\n")
    assert parse_steps(stderr) == {"consumer get once sealed": 14.1, "consumer get once sealed (mean)": 15.0}


def test_no_step_lines_give_no_steps():
    assert parse_steps("Traceback (most recent call last):\n  ...\n") == {}


def test_each_step_is_the_median_over_the_runs_that_printed_it():
    runs = [{"steps": {"producer create": 50.0, "consumer read": 30.0}},
            {"steps": {"producer create": 70.0}},
            {"steps": {"producer create": 60.0, "consumer read": 40.0}}]
    assert step_medians(runs) == {"producer create": 60.0, "consumer read": 35.0}
