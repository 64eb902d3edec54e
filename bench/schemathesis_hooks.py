"""schemathesis hooks for bench/schemathesis_run.py: which "schema-valid request rejected"
(ST202) answers are rules JSON Schema cannot state.

The OpenAPI schema states every rule about one value (types, ranges, lengths, enums, the zoo's
names and each family's config keys). Some rules relate several values, and JSON Schema has
no way to say them; a request that breaks one is schema-valid and still refused (422 naming
the field). Such a failure is set aside here only when every error of the answer matches one
of RELATIONAL below; every other failure stays. Each set-aside answer is written to the file
in AUTOPAR_ST_SET_ASIDE (one JSON line: the rule, the operation, the message) for the report.
"""

from __future__ import annotations

import json
import os
import re

import schemathesis

# (rule, what the 422 says): each relates two or more values of the request, or the request
# to the service's own limits.
RELATIONAL = [
    ("hidden divisible by heads (and heads by kv_heads)", r"is not divisible by|must divide"),
    ("parameter count of the configured model", r"parameters is past any real model"),
    (
        "devices: nodes x devices per node",
        r"devices; at most|nodes make [0-9,]+ devices|no cluster has",
    ),
    ("planning work within the per-job time limit", r"past this service's per-job limit"),
    ("sizing: min_nodes <= max_nodes, at most 16 sizes", r"1 <= min <= max|node counts"),
    # "64-1024": the schema states the form; the bounds are numbers within the batch limit.
    (
        "a global batch range: 1 <= LO <= HI <= the limit",
        r"^training\.global_batch_size: .*(expected an integer 1-|LO <= HI)",
    ),
    ("memory headroom amount below the device's memory", r"leaves less than a tenth"),
    # "15T", "30d", "5%": the schema states the form; the value is the number times its unit.
    (
        "a quantity's value with its unit, within bounds",
        r"expected between 1 and|positive duration of at most|is outside \[0, 0.9\]",
    ),
    # Stored profiles come and go (POST /v1/clusters): the names the schema could list change.
    ("a cluster name names a bundled or stored profile", r"unknown cluster"),
    # An OpGraph from `autopar trace`: its own format, validated in a process of its own.
    ("graph content, as autopar trace writes it", r"^model\.graph"),
    ("price given with a token count", r"given without"),
    # Pins against each other and against the cluster (mesh product, cp dividing dp, ...).
    ("search pins that contradict each other or the cluster", r"^search\."),
    # A config.json is read by transformers' own config class: its keys are transformers'.
    ("hf_config content, as transformers reads it", r"^model\.hf_config|^hf_config"),
]


def _errors(response) -> list[str]:
    try:
        detail = json.loads(response.content)["detail"]
    except (ValueError, KeyError, TypeError):
        return []
    if not isinstance(detail, list):
        return []
    return [
        ".".join(str(p) for p in item.get("loc", []) if p != "body") + ": " + item.get("msg", "")
        for item in detail
    ]


def _rule(text: str) -> str | None:
    for rule, pattern in RELATIONAL:
        if re.search(pattern, text) or re.search(pattern, text.split(": ", 1)[-1]):
            return rule
    return None


@schemathesis.hook
def filter_failure(context, failure, case, response) -> bool:
    if getattr(failure, "code", "") != "ST202" or response.status_code != 422:
        return True
    errors = _errors(response)
    rules = [_rule(e) for e in errors]
    if not errors or None in rules:
        return True
    path = os.environ.get("AUTOPAR_ST_SET_ASIDE")
    if path:
        with open(path, "a") as out:
            line = {"rule": rules[0], "operation": case.operation.label, "error": errors[0][:300]}
            out.write(json.dumps(line) + "\n")
    return False
