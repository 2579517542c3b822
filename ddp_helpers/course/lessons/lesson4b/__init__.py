"""Deep dive 4b, clusters in depth: who is machine 0, a machine joining a running job, the rendezvous options,
the rendezvous store's trust, one `srun` task per rank without torchrun, preemption. Its checks are in the notebook;
its code is lesson 4's (`lesson4.srun`, `lesson4.preemption`, ...) and its quiz."""
