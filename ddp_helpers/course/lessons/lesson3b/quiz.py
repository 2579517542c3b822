"""Deep dive 3b's quiz: its questions, answers and explanations, kept here rather than in the notebook's cells,
where the right answer would sit in full view above the radio buttons."""

from ...quiz import Question

QUESTIONS = [
    Question("A model is built on meta and sharded over 2 CPU ranks; after to_empty, each rank calls torch.manual_seed(0) "
             "and torch.nn.init.normal_ on its local shards (p.to_local()). What do the weights hold?",
             ("What one process would draw for the whole tensors", "Rank 1's rows repeat rank 0's numbers: the model "
              "changes with the world size", "Nothing: meta tensors cannot be initialised"), 1,
             "Each rank draws from the start of the same stream for its own rows. A rule per row of the whole tensor "
             "gives the same numbers at any world size (DTensor's own random ops on GPUs give each shard a stream of "
             "its own, but other numbers at another world size).",
             "Which numbers would one process give the second half of the rows?"),
    Question("Under FSDP2, each rank calls clip_grad_norm_(model.parameters(), 1.0) on its sharded gradients. "
             "Which norm does it clip by?",
             ("Each rank's own shards' norm: the ranks clip differently", "The whole gradient's norm, the same on "
              "every rank", "None: clipping is refused on DTensors"), 1,
             "The gradients are DTensors: each rank squares its part, an all-reduce sums the squares over the ranks, "
             "and the root is the whole gradient's norm. So every rank must make the call: it is a collective.",
             "What did the cell compare the returned norm with?"),
    Question("Activation checkpointing in each FSDP block: what does the backward pay for the memory it saves?",
             ("A second all-gather of each block's weights", "Each block's forward run again, with the weights "
              "FSDP has just gathered for its backward", "Nothing: the activations are recomputed for free"), 1,
             "The recomputed forward runs inside the block's backward, when FSDP has gathered the block's weights "
             "already: compute, not communication. The cell counted the same all-gathers both ways.",
             "Count the all-gathers per step with and without checkpointing."),
]
