"""Lesson 3's quiz: its questions, answers and explanations, kept here rather than in the notebook's cells,
where the right answer would sit in full view above the radio buttons."""

from ...quiz import Question

QUESTIONS = [
    Question("DDP runs with forward_sync_buffers=True (the default). Whose data do BatchNorm's running statistics describe?",
             ("Every rank's, averaged", "Rank 0's batches only", "The last rank's to finish"), 1,
             "Each forward starts from rank 0's buffers, updated with this rank's batch: rank 0's statistics never see another rank's data.",
             "Look at which reference line rank 0's running mean followed."),
    Question("You train on CPU ranks and call nn.SyncBatchNorm.convert_sync_batchnorm(model). What happens in training?",
             ("Statistics are synchronised over gloo", "It raises a ValueError: SyncBatchNorm needs GPU tensors",
              "It works, but slower"), 1,
             "SyncBatchNorm refuses CPU tensors in training (and without a process group it silently acts as plain BatchNorm).",
             "What did rank 0 record in the SyncBatchNorm cell?"),
    Question("A model with Adam in float32 has 1 billion parameters. About how much memory does one FSDP rank need for that state at world 8?",
             ("16 GB", "2 GB", "8 GB"), 1,
             "16 bytes per parameter is 16 GB, split 8 ways: 2 GB (plus the whole weights of the layer being computed).",
             "16 bytes per parameter, divided by the world size."),
    Question("Why can ZeRO-1 not split Adam's state evenly over 4 ranks for a model with two big weight matrices?",
             ("It gives each rank whole parameters", "gloo limits message sizes", "Adam's state cannot be split"), 0,
             "ZeroRedundancyOptimizer assigns whole parameters to ranks; FSDP splits every parameter.",
             "Compare the bars per rank at world 4."),
    Question("A job saved with torch.distributed.checkpoint on 2 ranks. Where can it resume?",
             ("Only on 2 ranks", "On any number of ranks, and in a plain process", "Only after converting with dcp_to_torch_save"), 1,
             "The metadata says which piece of which tensor is where; each loading rank reads what its own sharding needs.",
             "Look at the world sizes the checkpoint loaded at."),
]
