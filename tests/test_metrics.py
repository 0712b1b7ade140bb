import json

import numpy as np
import pytest

from llmc.bench.summary import (good_requests, goodput, meets_slo, percentiles, slo_violations, summarize_requests,
                                summarize_run, throughput)
from llmc.runtime.metrics import RequestTimes


def _times(arrival, tokens, scheduled=None):
    return RequestTimes(arrival=arrival, first_scheduled=scheduled, token_times=list(tokens))


def test_metric_definitions_on_hand_made_timestamps():
    r = _times(10.0, [11.0, 11.5, 12.5, 13.0], scheduled=10.25)
    assert r.num_tokens == 4
    assert r.queue_time == pytest.approx(0.25)
    assert r.ttft == pytest.approx(1.0)
    assert r.e2e == pytest.approx(3.0)
    assert r.tpot == pytest.approx((3.0 - 1.0) / 3)
    assert r.itl == pytest.approx([0.5, 1.0, 0.5])


def test_single_token_has_no_tpot():
    r = _times(1.0, [1.5])
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(0.5)
    assert r.tpot is None
    assert r.itl == []


def test_no_tokens_yet():
    r = RequestTimes(arrival=3.0)
    assert r.ttft is None and r.e2e is None and r.tpot is None and r.queue_time is None
    assert r.itl == []


def test_record_token_and_mark_scheduled():
    r = RequestTimes(arrival=0.0)
    r.mark_scheduled(0.5)
    r.mark_scheduled(0.9)  # only the first scheduling counts
    r.record_token(1.0)
    r.record_token(2.0)
    assert r.queue_time == 0.5
    assert r.token_times == [1.0, 2.0]

    now = RequestTimes(arrival=0.0)
    now.record_token()
    now.record_token()
    assert now.token_times[0] <= now.token_times[1]


def test_to_dict_is_json_ready():
    d = _times(0.0, [0.5, 1.0, 2.0], scheduled=0.25).to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["num_tokens"] == 3
    assert d["ttft"] == 0.5 and d["e2e"] == 2.0 and d["tpot"] == 0.75 and d["queue_time"] == 0.25


def test_percentiles_known_values():
    got = percentiles([1.0, 2.0, 3.0, 4.0])
    # Linear interpolation at rank (n - 1) * p / 100: p90 -> rank 2.7 -> 3 + 0.7 * (4 - 3).
    assert got == pytest.approx({"p50": 2.5, "p90": 3.7, "p95": 3.85, "p99": 3.97})
    assert list(got) == ["p50", "p90", "p95", "p99"]


def test_percentiles_match_numpy_and_custom_ps():
    values = np.random.default_rng(0).exponential(size=101).tolist()
    got = percentiles(values, ps=(0, 25, 99.9, 100))
    assert set(got) == {"p0", "p25", "p99.9", "p100"}
    assert got["p0"] == min(values) and got["p100"] == max(values)
    assert got["p99.9"] == pytest.approx(np.percentile(values, 99.9))


def test_percentiles_edge_cases():
    assert percentiles([]) == {}
    assert percentiles([7.0]) == {"p50": 7.0, "p90": 7.0, "p95": 7.0, "p99": 7.0}


def test_summarize_requests():
    reqs = [
        _times(0.0, [1.0, 2.0, 3.0], scheduled=0.5),  # ttft 1, tpot 1, e2e 3, gaps 1, 1
        _times(0.0, [2.0]),  # ttft 2, no tpot, e2e 2, not yet scheduled on record
        _times(1.0, [4.0, 4.5], scheduled=1.5),  # ttft 3, tpot 0.5, e2e 3.5, gap 0.5
        RequestTimes(arrival=5.0),  # no output yet: counted as a request only
    ]
    s = summarize_requests(reqs)
    assert s["counts"] == {"requests": 4, "with_tokens": 3, "with_tpot": 2, "output_tokens": 6, "itl_gaps": 3}
    assert s["ttft"]["p50"] == pytest.approx(2.0)
    assert s["ttft"]["p90"] == pytest.approx(2.8)
    assert s["tpot"]["p50"] == pytest.approx(0.75)
    assert s["e2e"]["p50"] == pytest.approx(3.0)
    assert s["itl"]["p50"] == pytest.approx(1.0)
    assert s["itl"]["p90"] == pytest.approx(1.0)
    assert s["queue_time"]["p50"] == pytest.approx(0.5)
    json.dumps(s)


def test_summarize_empty():
    s = summarize_requests([])
    assert s["counts"]["requests"] == 0
    assert s["ttft"] == {} and s["itl"] == {}


# -- rates and SLOs: hand-computed answers --------------------------------------------------

def _mixed_slo_requests():
    return [
        _times(0.0, [0.2, 0.3, 0.4]),  # ttft 0.2, tpot 0.1, gaps 0.1, 0.1: meets both SLOs
        _times(0.0, [0.8, 0.85]),  # ttft 0.8 > 0.5: misses TTFT
        _times(1.0, [1.3]),  # one token: ttft 0.3, no TPOT to miss: meets
        _times(1.0, [1.1, 1.4, 1.45]),  # tpot (1.45 - 1.1) / 2 = 0.175 > 0.15: misses TPOT
        RequestTimes(arrival=1.5),  # never produced a token: misses everything
    ]


def test_slo_violations_per_request():
    slo = {"ttft": 0.5, "tpot": 0.15}
    got = [slo_violations(r, slo) for r in _mixed_slo_requests()]
    assert got == [[], ["ttft"], [], ["tpot"], ["ttft", "tpot"]]


def test_one_token_output_cannot_miss_tpot_or_itl():
    one = _times(0.0, [0.4])
    assert one.tpot is None
    assert meets_slo(one, {"tpot": 0.001, "itl": 0.001})
    assert not meets_slo(one, {"ttft": 0.3})
    assert not meets_slo(one, {"e2e": 0.3})


def test_itl_slo_bounds_every_gap():
    r = _times(0.0, [0.1, 0.2, 0.5, 0.6])  # gaps 0.1, 0.3, 0.1: mean 0.167 but one gap of 0.3
    assert r.tpot == pytest.approx(0.5 / 3)
    assert meets_slo(r, {"tpot": 0.2})
    assert slo_violations(r, {"itl": 0.2}) == ["itl"]
    assert meets_slo(r, {"itl": 0.3})  # the limit itself is met


def test_unknown_slo_metric():
    with pytest.raises(ValueError, match="unknown SLO metric 'latency'"):
        slo_violations(_times(0.0, [1.0]), {"latency": 1.0})


def test_goodput_with_mixed_slo_results():
    reqs = _mixed_slo_requests()
    slo = {"ttft": 0.5, "tpot": 0.15}
    # Requests 0 and 2 meet both SLOs: 2 requests over 4 s of wall time.
    assert goodput(reqs, slo, wall_time=4.0) == pytest.approx(0.5)
    assert good_requests(reqs, slo) == [True, False, True, False, False]
    # A request that met its SLOs but was aborted does not count.
    assert goodput(reqs, slo, 4.0, completed=[True, True, False, True, False]) == pytest.approx(0.25)
    assert goodput(reqs, {}, 4.0) == pytest.approx(1.0)  # no SLO: every request with a token


def test_throughput_is_output_tokens_over_wall_time():
    reqs = _mixed_slo_requests()  # 3 + 2 + 1 + 3 + 0 = 9 tokens
    assert throughput(reqs, 3.0) == pytest.approx(3.0)


def test_summarize_run_adds_rates_and_attainment():
    reqs = _mixed_slo_requests()
    s = summarize_run(reqs, 4.0, {"ttft": 0.5, "tpot": 0.15}, completed=[True, True, True, True, False])
    assert s["counts"]["completed"] == 4 and s["counts"]["output_tokens"] == 9
    assert s["wall_time"] == 4.0
    assert s["throughput"] == pytest.approx(9 / 4)
    assert s["request_throughput"] == pytest.approx(4 / 4)
    assert s["goodput"] == pytest.approx(2 / 4)
    assert s["slo_attainment"] == pytest.approx(2 / 5)  # share of all requests, failed ones included
    # TPOT over the three requests that define it: 0.1, 0.05, 0.175 -> median 0.1.
    assert s["tpot"]["p50"] == pytest.approx(0.1)
    # ITL over all 5 gaps (0.1, 0.1, 0.05, 0.3, 0.05): sorted 0.05 0.05 0.1 0.1 0.3, p90 at rank 3.6.
    assert s["itl"]["p50"] == pytest.approx(0.1)
    assert s["itl"]["p90"] == pytest.approx(0.1 + 0.6 * 0.2)
    assert "goodput" not in summarize_run(reqs, 4.0)
    json.dumps(s)
    with pytest.raises(ValueError, match="wall_time"):
        summarize_run(reqs, 0.0)
