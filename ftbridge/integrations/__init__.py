"""ftbridge under other training frameworks; the only package of ftbridge that imports Hugging Face packages.

* :mod:`ftbridge.integrations.accelerate`: ``FaultTolerantAccelerator``, a drop-in for
  ``accelerate.Accelerator`` (``pip install 'ftbridge[hf]'``);
* :mod:`ftbridge.integrations.accelerate_data`: a prepared training loader re-sharded across replica groups;
* :mod:`ftbridge.integrations.transformers`: ``FaultTolerantTrainer``, a drop-in for ``transformers.Trainer``,
  and ``FaultTolerantTrainerMixin`` for its subclasses.

Each module checks the version of the framework it was written against, as :mod:`ftbridge.zero` does for
DeepSpeed. Nothing here is imported by ``import ftbridge``.
"""
