"""The planner (`gptpar plan`): predict a layout's step time, memory and cost before spending an allocation.

calibration.py holds what a device measured (the file `gptpar plan calibrate` writes) and answers "how long does
this much compute or this collective take here"; measure.py is the one module that imports torch, and makes such a
file; network.py prices a collective over a group of ranks (the calibration's own links, or a cluster profile's);
layout.py turns a resolved config into sizes, per-rank parameters and tokens; predict.py adds up one step from the
strategy tables' closed forms and `schedules.simulate`; search.py enumerates the layouts of N GPUs; commands.py prints
them; record.py writes a planned run's prediction (plan.json) for `gptpar report`. Nothing here but measure.py
imports torch, so `gptpar plan predict` answers on a login node.
"""
