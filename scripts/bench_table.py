#!/usr/bin/env python3
"""Turns `cargo bench --bench conv` output (stdin) into a markdown table of median GFLOP/s."""
import re
import sys

rates = {}
name = None
for line in sys.stdin:
    m = re.match(r"^(conv_\w+_f32|sgemm_f32)/(\S+)", line)
    if m:
        name = (m.group(1), m.group(2))
    t = re.search(r"thrpt:\s+\[\S+ \S+ (\S+) (\S)elem/s", line)
    if t and name:
        scale = {"G": 1.0, "M": 1e-3, "T": 1e3}[t.group(2)]
        rates[name] = float(t.group(1)) * scale
        name = None

groups = ["conv_forward_f32", "conv_backward_data_f32", "conv_backward_filter_f32", "sgemm_f32"]
print("| shape | forward | backward data | backward filter | sgemm | forward / sgemm |")
print("|---|---|---|---|---|---|")
for shape in dict.fromkeys(s for _, s in rates):
    r = [rates.get((g, shape)) for g in groups]
    cells = ["%.1f" % v if v else "-" for v in r]
    ratio = "%.0f%%" % (100 * r[0] / r[3]) if r[0] and r[3] else "-"
    print("| %s | %s | %s |" % (shape, " | ".join(cells), ratio))
