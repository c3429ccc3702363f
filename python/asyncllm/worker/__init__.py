"""The worker side of the engine core: the model runner, its persistent input
batch and the sampler. Everything here may touch torch and the device."""
