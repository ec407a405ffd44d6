"""Reports of a Plan: text tables, explain, schedule timeline (SVG/PNG/text), HTML report, plan diff."""
