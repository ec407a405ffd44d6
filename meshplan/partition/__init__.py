"""Pipeline partitioning: the schedule simulator (``schedule``) and the stage-split ILP
(``stage_ilp``) that scores splits with it. Torch-free."""
