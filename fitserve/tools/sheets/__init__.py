"""`fitserve plan TOOL ...`: planner sheets for questions met outside one engine (their index:
fitserve.tools.planner.sheet_index).

Each tool is a module here with ``add_arguments(parser)`` and ``build(args) -> Sheet``; the
shared runner (``sheet.run_tool``) adds ``--json`` and ``--explain``, renders the sheet as rich
tables, and turns a PlanError into exit status 2 with the reason. ``fitserve plan MODEL`` (the
deployment plan) is unchanged: a first argument naming a tool routes here instead.
"""
