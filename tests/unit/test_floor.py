"""The arithmetic a section does, counted, and its floor at the measured peak."""

from __future__ import annotations

import json
import math

import pytest
import torch

from arithlib.engine import counted_flops, counting
from arithlib.run.floor import TIMING_COLUMNS, Sections, matmul_peak, matmul_rate
from arithlib.run.stored import Store, sidecar


def test_a_matrix_product_counts_two_m_k_n():
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    with counting() as c:
        a @ b
        torch.nn.functional.linear(a, b.T.contiguous())
    assert c.flops == 2 * (2 * 5 * 7 * 3)


def test_backward_is_counted_and_element_wise_work_is_not():
    w = torch.randn(4, 6, requires_grad=True)
    x = torch.randn(3, 4)
    with counting() as c:
        y = (x @ w).relu().sum()
        forward = c.flops
        y.backward()
    assert forward == 2 * 3 * 4 * 6
    assert c.flops == 2 * forward  # the weight's gradient x^T @ dy (x needs none)


def test_an_inner_counting_block_adds_to_the_outer_total():
    assert counted_flops() is None
    with counting() as outer:
        torch.randn(2, 3) @ torch.randn(3, 4)
        with counting() as inner:
            assert inner is outer
            torch.randn(2, 3) @ torch.randn(3, 4)
        assert counted_flops() == 2 * 2 * 2 * 3 * 4
    assert counted_flops() is None


def test_sections_record_flops_floor_and_ratio():
    s = Sections(peak_gflop_s=1.0)
    with s("product"):
        torch.randn(64, 64) @ torch.randn(64, 64)
    with s("nothing"):
        pass
    t = s.table(total_wall_s=10.0)
    assert counted_flops() is None
    assert list(t.columns) == TIMING_COLUMNS
    assert list(t.section) == ["product", "nothing", "total"]
    row = t.set_index("section").loc["product"]
    assert row.gflop == pytest.approx(2 * 64**3 / 1e9, abs=1e-3)
    assert row.floor_s == pytest.approx(row.gflop / 1.0, abs=1e-3)
    assert math.isnan(t.set_index("section").loc["nothing", "ratio_to_floor"])  # no arithmetic, no floor
    total = t.set_index("section").loc["total"]
    assert total.wall_s == 10.0 and total.ratio_to_floor == pytest.approx(10.0 / total.floor_s, rel=1e-2)


def test_laps_split_what_ran_between_them_and_counting_stops_with_the_table():
    s = Sections(peak_gflop_s=1.0)
    torch.randn(64, 64) @ torch.randn(64, 64)
    s.lap("first")
    torch.randn(64, 32) @ torch.randn(32, 64)
    torch.randn(64, 32) @ torch.randn(32, 64)
    s.lap("second")
    t = s.table().set_index("section")
    assert counted_flops() is None
    assert t.gflop["first"] * 1e9 == pytest.approx(2 * 64**3, rel=1e-2)
    assert t.gflop["second"] * 1e9 == pytest.approx(2 * 2 * 64 * 32 * 64, rel=1e-2)
    assert t.gflop["total"] == pytest.approx(t.gflop["first"] + t.gflop["second"], abs=2e-6)


def test_a_failed_section_is_not_recorded_and_close_stops_counting():
    s = Sections(peak_gflop_s=1.0)
    with pytest.raises(ValueError), s("fails"):
        raise ValueError("x")
    s.close()
    assert counted_flops() is None and s.rows == []


def test_a_stored_result_keeps_the_arithmetic_it_took(tmp_path):
    store = Store(tmp_path)
    s = Sections([store], peak_gflop_s=1.0)
    compute = lambda: (torch.ones(32, 32) @ torch.ones(32, 32)).sum().item()  # noqa: E731
    with s("first"):
        store("product", compute, code=[], n=32)
    path = store.path("product", code=[], n=32)
    assert json.loads(sidecar(path).read_text())["gflop"] == pytest.approx(2 * 32**3 / 1e9)
    with s("again"):
        store("product", compute, code=[], n=32)
    again = s.table().set_index("section").loc["again"]
    assert s.table().set_index("section").loc["first"].reused_gflop == 0
    assert again.gflop == 0 and again.reused_gflop == pytest.approx(2 * 32**3 / 1e9, abs=1e-3)


def test_the_peak_is_a_measured_rate_with_its_setting():
    assert matmul_rate(8, 16, 16, seconds=0.01) > 0
    peak = matmul_peak(16, 32, rows=(8, 16), seconds=0.01)
    assert peak["rows"] in (8, 16) and peak["shape"] == [16, 32] and peak["gflop_s"] > 0
    assert peak["dtype"] == "float32" and peak["threads"] == torch.get_num_threads()


@pytest.mark.parametrize("end, used", [(4.0, 4.0), (0.5, 1.0)])
def test_the_floor_takes_the_higher_of_the_two_peak_measurements(end, used):
    """A peak measured while another job held the machine reads low; the table measures
    it again and every floor (the laps' too) is taken against the higher reading."""
    calls = []
    s = Sections(peak_gflop_s=1.0, remeasure=lambda: calls.append(1) or end)
    with s("product"):
        torch.randn(64, 64) @ torch.randn(64, 64)
    t = s.table(total_wall_s=10.0).set_index("section")
    s.table()  # measured once
    assert calls == [1]
    assert (t.peak_gflop_s == used).all()
    assert t.floor_s["product"] == pytest.approx(t.gflop["product"] / used, abs=1e-6)
    assert t.ratio_to_floor["total"] == pytest.approx(10.0 / (t.gflop["total"] / used), rel=1e-3)
