"""The search: per (micro-batch, tp) a tensor-parallel layout (the intra-op ILP, and
Megatron's as a second candidate); per mesh (pp, dp, tp) and training options the stage DP;
predict() per candidate; to_plan() for the winner, with its top-k alternatives and why.

Pruning, each exact under the cost model, lives with its technique (planner.parallel): ZeRO
levels in data.zero_groups; checkpointing only adds time, so it is tried only when no ZeRO
level fits without it; GPipe never beats 1F1B (pipeline.SEARCHED_SCHEDULES). Both the stage
DP's partition and the balanced one are predicted (the DP minimises the pipeline time;
predict adds the data-parallel sync and the optimizer step). Results are deterministic:
candidates are ordered by predicted step time, then by a fixed key; ILP solves may run in a
process pool and are collected by key, not completion order.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from planner.cost.memory import bytes_per_param
from planner.errors import AutoparError
from planner.evaluate.config import ParallelConfig
from planner.evaluate.layer_table import LayerTable
from planner.evaluate.predict import GraphFacts
from planner.evaluate.to_plan import to_plan
from planner.executable import MODULE_FAMILIES, family_not_executable, runs
from planner.gc_pause import collection_paused
from planner.parallel import checkpointing, context, data, expert, fp8, pipeline, sequence
from planner.parallel.tensor import (
    FOLDED_KIND,
    MEGATRON_KINDS,
    is_sequence_parallel,
    tp_layout_name,
)
from planner.parallel_dims import Combination
from planner.plan import Plan, SearchInfo
from planner.request import PlanningInputs
from planner.runtime import runtime_of
from planner.search import explain, submeshes
from planner.search.bounds import (
    Bar,
    fits_nowhere,
    p2p_lower_bound,
    step_lower_bound,
    table_work,
    zero3_rate,
)
from planner.search.infeasible import (
    cut_lines,
    memory_pins,
    no_executable_lines,
    not_fit_lines,
    schedule_lines,
)
from planner.search.layout_cache import LayoutCache, Progress
from planner.search.space import (
    SearchOptions,
    check_virtual_stages,
    combinations,
    executable_options,
    mesh_list,
    microbatch_count,
    runtime_options,
)
from planner.search.variant import Candidate, VariantContext, fitting_variants, shards


@dataclass
class SearchResult:
    plan: Plan
    candidates: list[Combination]  # every fitting one, best first
    ilp_calls: int
    ilp_max_vars: int
    layouts: LayoutCache

    def plan_for(self, candidate: Candidate) -> Plan:
        """The full Plan of any candidate (the search builds one only for the winner)."""
        return to_plan(
            candidate.prediction,
            self.layouts.graph(candidate.mbs),
            self.layouts.inputs.cluster,
            self.layouts.inputs.training,
            self.layouts.inputs.model,
            tokens_per_sample=self.layouts.inputs.tokens_per_sample,
            layouts=self.layouts.get(candidate.layout, candidate.mbs, candidate.config.tp),
            solver=self.plan.search.solver,
            tp_layout=tp_layout_name(candidate.layout),
            sequence_parallel=is_sequence_parallel(candidate.layout),
        )


class NoFeasiblePlan(AutoparError):
    """Nothing to return: nothing fits in memory (`reason` "memory"), or, with
    executable_only, nothing the executor can run does ("executable"), or the schedules asked
    for run with none of the micro-batch counts the pins leave ("schedule")."""

    def __init__(self, lines: list[str], reason: str = "memory"):
        self.explanation = lines
        self.reason = reason
        super().__init__(" ".join(lines))


def search(
    inputs: PlanningInputs,
    options: SearchOptions | None = None,
    progress: Progress | None = None,
    tables_ready: Callable[[LayoutCache], None] | None = None,
) -> SearchResult:
    """Plan training of the model in `inputs` on its cluster. `tables_ready` is called with
    the search's LayoutCache once its Megatron tables are built, before the configurations
    are evaluated (the baselines price their grids from them beside the search)."""
    with collection_paused():
        return _search(inputs, options, progress, tables_ready)


def _search(
    inputs: PlanningInputs,
    options: SearchOptions | None,
    progress: Progress | None,
    tables_ready: Callable[[LayoutCache], None] | None = None,
) -> SearchResult:
    started = time.perf_counter()
    options = options or SearchOptions()
    say = progress or (lambda _step, _done, _total: None)
    cluster, training = inputs.cluster, inputs.training
    options = runtime_options(options, runtime_of(training.runtime))
    layouts = LayoutCache(inputs, options, say)
    num_layers = max(inputs.base.num_layers, 1)
    family, seq = inputs.model.family, training.seq_len
    meshes = mesh_list(cluster, num_layers, options, inputs.model.config)
    model_config = inputs.model.config
    combos = combinations(
        meshes,
        training.global_batch_size,
        options,
        lambda dp: context.cp_options(family, seq, dp, options.cp, inputs.model.config),
        lambda cp, tp: context.comm_options(inputs.model.config, cp, tp, options.cp_comm),
        lambda dp, tp, cp: expert.ep_options(
            family, model_config, dp, tp, cp, options.ep, options.etp
        ),
    )
    tps = tuple(sorted({m[2] for m in meshes}))
    context.check_pin(options.cp, family, seq, combos, options.cp_comm, inputs.model.config, tps)
    expert.check_pin(
        *(options.ep, family, model_config, combos, options.zero_stages, training.runtime),
        meshes,
        etp=options.etp,
    )
    if options.executable_only and (why := family_not_executable(inputs.model.family)):
        raise NoFeasiblePlan([f"No executable plan: {why}."], reason="executable")
    check_virtual_stages(options, num_layers)
    submeshes.check_pin(options)
    sequence.check_pin(options.layouts, family, training.seq_len, combos, model_config)
    fp8.check_pin(options.fp8, cluster.device, training.dtype, family in MODULE_FAMILIES)
    run = SearchRun(inputs, options, layouts, started)
    # Megatron's layout (and tp = 1) first, cheapest bound first, so the bar is set early;
    # then the ILP's layouts for the (micro-batch, tp) whose ideal bound can still clear it.
    keys = sorted({(c.mbs, c.tp) for c in combos})
    tables = [("megatron", *k) for k in keys]
    tables += [("megatron_sp", *k) for k in keys if "megatron_sp" in run.kinds(k[1])]
    folded = sorted({(c.mbs, c.tp) for c in combos if c.etp == 1})
    tables += [(FOLDED_KIND, *k) for k in folded if "megatron_sp" in run.kinds(k[1])]
    for kind in MEGATRON_KINDS:
        for recipe in run.recipes(kind, 2):
            if recipe is not None:  # each (mbs, tp) whose layout takes it
                table_kind = fp8.table_kind(kind, recipe)
                tables += [(table_kind, *k) for k in keys if kind in run.kinds(k[1]) or k[1] == 1]
    if "ilp" in options.layouts:  # the bounds that decide which ILP layouts to solve
        tables += [("ideal", *k) for k in keys if k[1] > 1]
    layouts.build_all(tables, "Megatron layouts and bounds per (micro-batch, tp)")
    if tables_ready is not None:
        tables_ready(layouts)
    ordered = sorted(combos, key=run.bound_order)
    for idx, combo in enumerate(ordered):
        say("pipeline and data-parallel options", idx + 1, len(ordered))
        if run.out_of_time():
            break
        tp = combo.tp
        if tp == 1:
            if options.layouts != ("megatron_sp",):  # one layout on a 1-wide tp axis
                run.evaluate(combo, [options.layouts[0]])
        else:
            run.evaluate(combo, run.kinds_of(combo))
    if "ilp" in options.layouts and not run.cut:
        ilp_keys = [(mbs, tp) for mbs, tp in keys if tp > 1]  # their bounds built above
        layouts.prepare([key for key in ilp_keys if run.may_clear_bar(key, combos)])
        # context parallelism runs with Megatron's layouts only (planner.parallel.context)
        todo = [c for c in ordered if c.tp > 1 and c.cp == 1 and (c.mbs, c.tp) in layouts.solved]
        for idx, combo in enumerate(todo):
            say("meshes with the ILP's layouts", idx + 1, len(todo))
            if run.out_of_time():
                break
            run.evaluate(combo, ["ilp"])
    return _result(run)


def _result(run: SearchRun) -> SearchResult:
    inputs, options, layouts, candidates = run.inputs, run.options, run.layouts, run.candidates
    cluster, training = inputs.cluster, inputs.training
    if not candidates and run.left_out:
        raise NoFeasiblePlan(no_executable_lines(run.left_out), reason="executable")
    if not candidates and run.cut:
        raise NoFeasiblePlan(cut_lines(options.time_limit), reason="time")
    if not candidates and not run.evaluated and not run.pruned and run.refusals:
        raise NoFeasiblePlan(schedule_lines(options.schedules, run.refusals), "schedule")
    if not candidates:
        raise NoFeasiblePlan(not_fit_lines(inputs.base, cluster, training, memory_pins(options)))
    # Equally fast: the one leaving more memory free (the candidates' keys alone would
    # order, say, ZeRO-1 at 24.0 GiB before ZeRO-3 at 22.9 GiB at the same step time).
    candidates.sort(key=lambda c: (round(c.step_time_s, 12), c.peak_memory, c.key))
    best = candidates[0]
    solver = f"{options.solver} ILP per (micro-batch, tp) + stage DP"
    per_stage = None
    if submeshes.searched(options, cluster.num_devices):
        required = options.stage_meshes == ("per_stage",)
        per_stage = submeshes.per_stage_search(run, candidates, required)
        if per_stage is None and required:
            raise NoFeasiblePlan(submeshes.none_fits_lines(cluster), reason="memory")
    if per_stage is not None:
        solver = f"{options.solver} ILP per (micro-batch, tp) + stage-submesh DP"
    if per_stage is not None and not per_stage.uniform:
        plan = submeshes.per_stage_plan(per_stage, layouts, solver, best.step_time_s)
        if options.executable_only and not plan.executable:
            raise NoFeasiblePlan(submeshes.not_executable_lines(plan), reason="executable")
    else:
        # the uniform search's best, or a better split on one mesh the pass found (pinned,
        # the pass returns its best even where slower: on one mesh the uniform best wins)
        better = per_stage is not None and per_stage.step_time_s < best.step_time_s
        one = per_stage.meshes[0] if better else None
        prediction = per_stage.prediction if one is not None else best.prediction
        mbs, layout = (one.microbatch_size, one.layout) if one else (best.mbs, best.layout)
        plan = to_plan(
            prediction,
            layouts.graph(mbs),
            cluster,
            training,
            inputs.model,
            tokens_per_sample=inputs.tokens_per_sample,
            layouts=layouts.get(layout, mbs, prediction.config.tp),
            solver=solver,
            started=run.started,
            tp_layout=tp_layout_name(layout),
            sequence_parallel=is_sequence_parallel(layout),
        )
    info = SearchInfo(
        time_s=time.perf_counter() - run.started,
        solver=solver,
        ilp_calls=layouts.ilp_calls,
        ilp_max_vars=layouts.ilp_max_vars,
        candidates_evaluated=run.evaluated,
        candidates_pruned=run.pruned,
        complete=not run.cut,
    )
    notes = [] if per_stage is not None else explain.why(best, candidates)
    if run.cut:
        notes.insert(0, run.cut_note())
    plan = plan.model_copy(
        update={
            "alternatives": explain.alternatives(
                candidates, options.top_k, first=per_stage is not None
            ),
            "search": info,
            "explanation": plan.explanation + notes,
        }
    )
    return SearchResult(plan, candidates, layouts.ilp_calls, layouts.ilp_max_vars, layouts)


class SearchRun:
    """One search's state: tables per layout, the candidates, the bar and the clock."""

    def __init__(self, inputs: PlanningInputs, options: SearchOptions, layouts, started: float):
        self.inputs, self.options, self.layouts, self.started = inputs, options, layouts, started
        self.cm = layouts.cm
        self.facts: dict[int, GraphFacts] = {}
        self.candidates: list[Combination] = []
        self.bar = Bar(options.top_k)
        self.evaluated = self.pruned = self.left_out = 0
        self.refusals: set[str] = set()  # why torch runs a schedule asked for with none of it
        self.cut = False
        self.combos_done = 0
        self._zero3: dict[tuple, tuple[float, float]] = {}
        self._p2p: dict[tuple, float] = {}
        self._work: dict[tuple, float] = {}
        self._attention: context.AttentionBytes | None = None
        self._experts: expert.ExpertLayers | None = None

    def prune(self, count: int = 1) -> None:
        """Count configurations skipped: their bound cannot win, or they fit nowhere."""
        self.pruned += count

    def count_evaluated(self, count: int) -> None:
        self.evaluated += count

    def beaten(self, bound: float) -> bool:
        """Whether a configuration with this lower bound cannot enter the top k."""
        return self.bar.beaten(bound)

    def zero3_of(self, cfg: ParallelConfig) -> tuple[float, float] | None:
        """(seconds per parameter element, overlap) of ZeRO-3 on this mesh, for the bound."""
        if cfg.zero != 3 or cfg.dp == 1:
            return None
        key = (cfg.pp, cfg.dp, cfg.tp, cfg.dp_shard)
        if key not in self._zero3:
            cluster, training = self.inputs.cluster, self.inputs.training
            per = bytes_per_param(training.dtype, training.optimizer)
            rate = zero3_rate(self.cm, cluster, cfg, per)
            self._zero3[key] = (rate, min(1.0, cluster.efficiency.overlap))
        return self._zero3[key]

    def work_of(self, table: LayerTable, checkpointing: bool) -> float:
        """table_work, once per (table, checkpointing)."""
        key = (id(table), checkpointing)
        if key not in self._work:
            self._work[key] = table_work(table, checkpointing, self.inputs.cluster)
        return self._work[key]

    def p2p_of(self, table: LayerTable, cfg: ParallelConfig) -> float:
        key = (id(table), cfg.pp, cfg.dp, cfg.tp, cfg.virtual_stages)
        if key not in self._p2p:
            self._p2p[key] = p2p_lower_bound(self.cm, table, cfg)
        return self._p2p[key]

    def out_of_time(self) -> bool:
        limit = self.options.time_limit
        if limit is not None and time.perf_counter() - self.started > limit:
            self.cut = True
        return self.cut

    def cut_note(self) -> str:
        return (
            f"The search was cut at its time limit of {self.options.time_limit:g} s after "
            f"{self.combos_done} (mesh, micro-batch, layout) evaluations; this is the best plan "
            "found so far (the cheapest bounds were tried first)."
        )

    def facts_at(self, mbs: int) -> GraphFacts:
        if mbs not in self.facts:
            self.facts[mbs] = self.inputs.facts_at(mbs)
        return self.facts[mbs]

    def _bound(self, table: LayerTable, combo: Combination) -> float:
        training = self.inputs.training
        pp, dp, tp, _mbs, cp, cp_comm, ep, etp = combo
        cfg = ParallelConfig(
            dp,
            tp,
            pp,
            microbatch_count(training.global_batch_size, combo),
            "interleaved_1f1b" if pp > 1 else "1f1b",
            2 if pp > 1 else 1,
            zero=1 if dp > 1 else 0,
            cp=cp,
            cp_comm=cp_comm,
            ep=ep,
            etp=etp,
        )
        work = self.work_of(table, False)
        return step_lower_bound(table, cfg, training.optimizer, self.cm.mem_rate, work)

    def bound_order(self, combo: Combination) -> float:
        kinds = self.kinds_of(combo) if combo.etp == 1 else ["megatron"]
        if not kinds:
            return 0.0
        table = self.table_for(kinds[0], combo)
        if table is None:
            return 0.0
        return self._bound(table, combo)

    def table_for(self, kind: str, combo: Combination) -> LayerTable | None:
        """The layout's table at the combination's (micro-batch, tp), as one of its cp ranks
        runs it (planner.parallel.context.scaled_table)."""
        tp, mbs, cp = combo.tp, combo.mbs, combo.cp
        table = self.layouts.table(kind, context.table_batch(mbs, cp), tp)
        if table is None:
            return table
        if cp > 1:
            if self._attention is None:
                self._attention = context.AttentionBytes.of(self.inputs.base)
            attention = self._attention
            table = context.scaled_table(table, cp, attention, mbs, tp, self.cm, combo.cp_comm)
        if combo.ep > 1:
            if self._experts is None:
                imbalance = self.inputs.training.expert_imbalance
                self._experts = expert.ExpertLayers.of(self.inputs.base, imbalance)
            table = expert.scaled_table(
                table, combo.ep, self._experts, mbs, tp, self.cm, cp, combo.folded
            )
        return table

    def may_clear_bar(self, key: tuple[int, int], combos: list[Combination]) -> bool:
        """Whether any configuration with the ILP's layout at (micro-batch, tp) can matter:
        bounded with every node split perfectly over tp (no layout needs less time or
        memory), over the variants that can fit."""
        mbs, tp = key
        ideal = self.layouts.table("ideal", mbs, tp)
        work = {ckpt: table_work(ideal, ckpt) for ckpt in checkpointing.modes()}
        training, capacity = self.inputs.training, self.inputs.cluster.usable_memory_bytes
        for combo in combos:
            if (combo.mbs, combo.tp) != key or combo.cp > 1 or combo.ep > 1:
                continue
            for cfg in self.variants(combo):
                bound = step_lower_bound(
                    ideal,
                    cfg,
                    training.optimizer,
                    self.cm.mem_rate,
                    work[cfg.checkpointing],
                    zero3=self.zero3_of(cfg),
                )
                if self.bar.beaten(bound):
                    continue
                precision = (training.dtype, training.optimizer)
                if not fits_nowhere(ideal, cfg, *precision, capacity, training.runtime):
                    return True
        return False

    def schedules(self, pp: int, m: int):
        """(schedule, virtual stages) the search runs on pp stages with m micro-batches."""
        num_layers = max(self.inputs.base.num_layers, 1)
        pinned = self.options.virtual_stages
        self.refusals |= pipeline.refusals(self.options.schedules, pp, m)
        for schedule in pipeline.searched_schedules(self.options.schedules, pp, m):
            if not pipeline.zero_stages_for(schedule, self.options.zero_stages):
                continue
            for v in pipeline.virtual_stage_counts(schedule, pp, num_layers, pinned, m):
                yield schedule, v

    def variants(self, combo: Combination):
        """Every configuration of one candidate the search may evaluate."""
        options, (pp, dp, tp, _mbs, cp, cp_comm, ep, etp) = self.options, combo
        m = microbatch_count(self.inputs.training.global_batch_size, combo)
        for schedule, v in self.schedules(pp, m):
            allowed = pipeline.zero_stages_for(schedule, options.zero_stages)
            allowed = expert.zero_levels(allowed, ep, self.inputs.training.runtime)
            per_node = self.inputs.cluster.devices_per_node
            for ckpt in options.checkpointing:
                for zeros in data.zero_groups(dp, allowed):
                    for zero in zeros:
                        for shard in shards(options, dp, tp, zero, per_node, cp, ep):
                            yield ParallelConfig(
                                *(dp, tp, pp, m, schedule, v, zero, ckpt, shard, cp),
                                cp_comm=cp_comm,
                                ep=ep,
                                etp=etp,
                            )

    def recipes(self, kind: str, tp: int, mode: str | None = None) -> tuple[str | None, ...]:
        """fp8 recipes searched with this layout kind (planner.parallel.fp8): pinned, or
        tensorwise beside none where the device has fp8 and the module path runs it (`mode`)."""
        inputs = self.inputs
        swaps = (kind in MEGATRON_KINDS or tp == 1) and inputs.model.family in MODULE_FAMILIES
        swaps = swaps and (runs(mode or "modules", "fp8") or not self.options.executable_only)
        return fp8.searched(self.options.fp8, swaps, inputs.cluster.device, inputs.training.dtype)

    def kinds(self, tp: int) -> list[str]:
        """Megatron's layouts searched at this tp: with and without sequence parallelism."""
        model, seq = self.inputs.model, self.inputs.training.seq_len
        return sequence.megatron_kinds(self.options.layouts, model.family, seq, tp, model.config)

    def kinds_of(self, combo: Combination) -> list[str]:
        """The layouts a combination is evaluated with: with expert tp 1, sequence
        parallelism's with the MoE blocks on token shards (FOLDED_KIND) where it is searched;
        else kinds(tp)."""
        if combo.etp == 1:
            return [FOLDED_KIND] if "megatron_sp" in self.kinds(combo.tp) else []
        return self.kinds(combo.tp)

    def evaluate(self, combo: Combination, kinds: list[str]) -> None:
        tp, cp = combo.tp, combo.cp
        self.combos_done += 1
        options = self.options
        m = microbatch_count(self.inputs.training.global_batch_size, combo)
        for kind in kinds:
            if (cp > 1 or combo.ep > 1) and tp > 1 and kind not in (*MEGATRON_KINDS, FOLDED_KIND):
                # context parallelism, and experts split over ep beside tp (their features
                # over tp as Megatron's layout splits them), run with Megatron's layouts only
                continue
            # None: it would run in graph mode, which cannot run it (only executable plans)
            mode = self.layouts.executor_mode(kind, combo.mbs, tp)
            here = executable_options(options, mode)
            table = None if here is None else self.table_for(kind, combo)
            self.left_out += table is None and options.executable_only
            if table is None:
                continue
            recipes = self.recipes(kind, tp, mode)
            tables = {r: self.table_for(fp8.table_kind(kind, r), combo) for r in recipes}
            todo = fp8.worth_evaluating(tables)
            self.pruned += len(tables) - len(todo)
            for recipe, table in todo:
                self._evaluate_recipe(combo, kind, recipe, table, m, here)

    def _evaluate_recipe(
        self, combo: Combination, kind: str, recipe, table, m: int, options
    ) -> None:
        facts = self.facts_at(combo.mbs)
        ctx = VariantContext(
            *(self.inputs, facts, table, kind, options, self.cm, combo.cp, combo.cp_comm),
            fp8=recipe,
            ep=combo.ep,
            etp=combo.etp,
        )
        for schedule, v in self.schedules(combo.pp, m):
            for found in fitting_variants(ctx, self, combo.grid, m, combo.mbs, schedule, v):
                if found is not None:
                    self.candidates.append(found)
                    self.bar.add(combo.grid, found.step_time_s)
