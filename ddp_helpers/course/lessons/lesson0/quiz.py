"""Lesson 0's quiz: its questions, answers and explanations, kept here rather than in the notebook's cells,
where the right answer would sit in full view above the radio buttons."""

from ...quiz import Question

QUESTIONS = [
    Question("Four ranks hold 1, 4, 9 and 16, and each calls dist.all_reduce on its tensor. What does rank 2 hold after it?",
             ("9: all_reduce only sends", "30: the sum, on every rank", "7.5: the mean"), 1,
             "all_reduce sums (by default) every rank's tensor and leaves the result in place on every rank.",
             "What is combined, and who gets the result?"),
    Question("Both ranks ran the same hello cell, yet each printed its own rank. Where does the difference come from?",
             ("The notebook sends each rank a different copy of the cell",
              "torchrun starts the same script in every process and gives each its own RANK and WORLD_SIZE, which "
              "`init_process_group` reads",
              "The ranks take turns: rank 1 runs once rank 0 has finished"), 1,
             "One program, many processes: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE (and where to meet, "
             "MASTER_ADDR and MASTER_PORT) in each process's environment, and init_process_group's default env:// "
             "reads them. A script does different work on different ranks only where it branches on its rank.",
             "What did each process get from torchrun before the script's first line ran?"),
]
