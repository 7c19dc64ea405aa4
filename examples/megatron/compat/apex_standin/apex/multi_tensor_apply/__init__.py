"""``apex.multi_tensor_apply.multi_tensor_applier``: calls the (``amp_C``) op on the whole lists at once."""


class MultiTensorApply:
    available = True
    warned = False

    def __init__(self, chunk_size=2048 * 32):
        self.chunk_size = chunk_size

    def __call__(self, op, noop_flag_buffer, tensor_lists, *args):
        return op(noop_flag_buffer, tensor_lists, *args)


multi_tensor_applier = MultiTensorApply()
