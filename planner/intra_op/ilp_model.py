"""The sharding ILP as plain arrays (columns with costs and bounds, sparse rows), solved by
HiGHS through highspy directly or by CBC through pulp. Building through pulp's expression
objects cost more than HiGHS's solve on an 80-layer model; arrays cost a fraction of it."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import numpy as np


@dataclass
class LinearModel:
    cost: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)  # lower bounds are all 0
    integer: list[bool] = field(default_factory=list)
    row_lower: list[float] = field(default_factory=list)
    row_upper: list[float] = field(default_factory=list)
    row_start: list[int] = field(default_factory=lambda: [0])
    row_index: list[int] = field(default_factory=list)
    row_value: list[float] = field(default_factory=list)

    def column(self, binary: bool) -> int:
        self.cost.append(0.0)
        self.upper.append(1.0)
        self.integer.append(binary)
        return len(self.cost) - 1

    def add_cost(self, col: int, value: float) -> None:
        self.cost[col] += value

    def row(self, index: list[int], value: list[float], lower: float, upper: float) -> None:
        self.row_index += index
        self.row_value += value
        self.row_start.append(len(self.row_index))
        self.row_lower.append(lower)
        self.row_upper.append(upper)

    @property
    def num_cols(self) -> int:
        return len(self.cost)

    @property
    def num_rows(self) -> int:
        return len(self.row_lower)


@dataclass
class ModelResult:
    values: list[float]
    status: str  # optimal | time_limit | infeasible | <solver's word>
    gap: float | None
    solve_s: float


def solve_model(model: LinearModel, solver: str, time_limit: float | None) -> ModelResult:
    started = time.perf_counter()
    if solver == "highs":
        return _highs(model, time_limit, started)
    return _cbc(model, time_limit, started)


def _highs(model: LinearModel, time_limit: float | None, started: float) -> ModelResult:
    import highspy

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    # No worker threads: the search forks processes that solve (planner.search.layout_cache),
    # and a forked child waits forever on a parent's HiGHS threads (seen with highspy 1.16).
    h.setOptionValue("threads", 1)
    if time_limit is not None:
        h.setOptionValue("time_limit", float(time_limit))
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = model.num_cols, model.num_rows
    lp.col_cost_ = np.asarray(model.cost, float)
    lp.col_lower_ = np.zeros(model.num_cols)
    lp.col_upper_ = np.asarray(model.upper, float)
    lp.row_lower_ = np.asarray(model.row_lower, float)
    lp.row_upper_ = np.asarray(model.row_upper, float)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.asarray(model.row_start, np.int32)
    lp.a_matrix_.index_ = np.asarray(model.row_index, np.int32)
    lp.a_matrix_.value_ = np.asarray(model.row_value, float)
    kinds = (highspy.HighsVarType.kContinuous, highspy.HighsVarType.kInteger)
    lp.integrality_ = [kinds[b] for b in model.integer]
    h.passModel(lp)
    h.run()
    solve_s = time.perf_counter() - started
    status = h.modelStatusToString(h.getModelStatus()).lower()
    gap = float(h.getInfo().mip_gap)
    gap = gap if gap < 1e30 else None
    values = list(h.getSolution().col_value)
    if "infeasible" in status:
        return ModelResult(values, "infeasible", None, solve_s)
    if "time limit" in status:
        return ModelResult(values, "time_limit", gap, solve_s)
    return ModelResult(values, "optimal" if status == "optimal" else status, gap or 0.0, solve_s)


def _cbc(model: LinearModel, time_limit: float | None, started: float) -> ModelResult:
    import pulp

    prob = pulp.LpProblem("sharding", pulp.LpMinimize)
    # pulp >= 3.3 attaches variables to the problem (constructing them alone is deprecated).
    new = getattr(prob, "add_variable", None) or pulp.LpVariable
    cols = [
        new(f"x{i}", lowBound=0, upBound=up, cat=pulp.LpBinary if b else pulp.LpContinuous)
        for i, (up, b) in enumerate(zip(model.upper, model.integer, strict=True))
    ]
    prob += pulp.LpAffineExpression([(cols[i], c) for i, c in enumerate(model.cost) if c])
    for r in range(model.num_rows):
        a, b = model.row_start[r], model.row_start[r + 1]
        expr = pulp.LpAffineExpression(
            [(cols[i], v) for i, v in zip(model.row_index[a:b], model.row_value[a:b], strict=True)]
        )
        lo, up = model.row_lower[r], model.row_upper[r]
        prob += (expr == lo) if lo == up else (expr <= up), f"r{r}"
    with warnings.catch_warnings():
        # pulp 3.3 deprecates its bundled CBC binary in favour of an external install; the
        # bundled one still works offline, which is what we need (pyproject pins pulp < 4).
        warnings.simplefilter("ignore", DeprecationWarning)
        engine = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit)
    prob.solve(engine)
    solve_s = time.perf_counter() - started
    status = pulp.LpStatus[prob.status]
    values = [v.value() or 0.0 for v in cols]
    if status == "Infeasible":
        return ModelResult(values, "infeasible", None, solve_s)
    if time_limit is not None and solve_s >= 0.98 * time_limit:
        return ModelResult(values, "time_limit", None, solve_s)
    optimal = status == "Optimal"
    return ModelResult(
        values, "optimal" if optimal else status.lower(), 0.0 if optimal else None, solve_s
    )
