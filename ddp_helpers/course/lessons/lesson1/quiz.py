"""Lesson 1's quiz: its questions, answers and explanations, kept here rather than in the notebook's cells,
where the right answer would sit in full view above the radio buttons."""

from ...quiz import Question

QUESTIONS = [
    Question("In data parallelism by hand, why divide the all-reduced gradient by the world size?",
             ("To make the all-reduce faster", "So that it is the mean over the whole batch, as one process would compute",
              "Because each rank holds a part of the model"), 1,
             "all_reduce sums the ranks' gradients; divided by the world size it is the gradient of the mean loss on the whole batch.",
             "What does one process compute with a mean loss over the whole batch?"),
    Question("A two-stage pipeline runs the batch as 4 micro-batches. About what share of the time does each stage idle?",
             ("1/2", "1/5", "0"), 1,
             "(p - 1) / (m + p - 1) = 1 / 5 with p = 2 stages and m = 4 micro-batches.",
             "Look at the formula and the plot above."),
    Question("What travels between the two stages of a pipeline?",
             ("The weights of the layers", "The activation at the cut, and its gradient back", "The gradients of all parameters"),
             1,
             "Each stage keeps its own layers; only the activation goes forward and its gradient comes back.",
             "Compare the bytes sent for the small and the big model."),
]
