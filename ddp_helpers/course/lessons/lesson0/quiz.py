"""Lesson 0's quiz: its questions, answers and explanations, kept here rather than in the notebook's cells,
where the right answer would sit in full view above the radio buttons."""

from ...quiz import Question

QUESTIONS = [
    Question("Four ranks hold 1, 4, 9 and 16, and each calls dist.all_reduce on its tensor. What does rank 2 hold after it?",
             ("9: all_reduce only sends", "30: the sum, on every rank", "7.5: the mean"), 1,
             "all_reduce sums (by default) every rank's tensor and leaves the result in place on every rank.",
             "What is combined, and who gets the result?"),
    Question("A %%torchrun cell calls record('x', value). Where does the value end up?",
             ("In the variable given by --out: run.ranks[r].facts['x'], one per rank", "In a file next to the notebook only",
              "Nowhere: record is only for printing"), 0,
             "Each rank's recorded values come back to the notebook: run.facts('x') lists them in rank order.",
             "Look at how the check above read rank and world_size."),
]
