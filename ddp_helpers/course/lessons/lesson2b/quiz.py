"""Deep dive 2b's quiz: its questions, answers and explanations, kept here rather than in the notebook's cells,
where the right answer would sit in full view above the radio buttons."""

from ...quiz import Question

QUESTIONS = [
    Question("Gradient accumulation over 4 micro-batches: what does model.no_sync() save?",
             ("Memory for activations", "The all-reduce of the first 3 micro-batches' gradients",
              "The optimizer step"),
             1,
             "Inside no_sync, backward() only accumulates locally; the all-reduce runs once, on the last micro-batch.",
             "Lesson 2's step 5 used no_sync to see one rank's own gradient: what did it skip?"),
    Question("Under DDP with a GradScaler, one step's gradients overflow on rank 1 only. What do the ranks do?",
             ("Rank 1 skips the step, the others take it", "Every rank skips the step and halves its scale",
              "The run stops with an error"),
             1,
             "The scaler's inf check is local, but it checks the gradients DDP averaged in backward(): rank 1's inf "
             "is in the sum on every rank, so every rank skips, and the weights stay equal.",
             "When the scaler looks for an inf, which gradients does each rank hold?"),
    Question("Three ranks evaluate 10 samples through the training DistributedSampler, then average their three "
             "accuracies. What is wrong?",
             ("Nothing: every sample is counted once",
              "The sampler pads 10 to 12 samples, and a mean of unequal shares' accuracies is not the accuracy",
              "The ranks see different models"),
             1,
             "Padding counts 2 samples twice, and averaging per-rank accuracies weighs a share of 3 like a share of 4. "
             "Sum the correct answers and the counts with all_reduce, then divide once.",
             "How many samples does the sampler hand out for 10 on 3 ranks?"),
]
