"""The features the README's table reports, one per group of patterns (in table order)."""

LAYERS = "Linear, conv, BatchNorm, sdpa with masks, embeddings, in-place ops, channels_last"
HOOKS = "module forward / backward hooks, Tensor.register_hook in forward"
BUFFERS = "buffers updated in forward"
VIEWS = "in-place updates through views (slices, narrow, select, as_strided)"
SIDE = "fp64 and complex side computations (left untouched)"
PARAM = "parametrizations (weight_norm, spectral_norm), torch.func.functional_call"
FUNCTION_GROUP = "custom torch.autograd.Function"
CHECKPOINTING = "activation checkpointing (reentrant, non-reentrant, selective)"
BREAKS = "graph breaks (.item(), print, untraceable builtins, data-dependent branches)"
USER_AUTOCAST = "the user's own torch.autocast regions in forward"
DOUBLE_BACKWARD = ("double backward (create_graph=True: gradient penalty, MAML, through "
                   "non-reentrant checkpointing) with compiler='eager'")
RETAIN_GRAPH = "backward(retain_graph=True) and a second backward over one forward"
DATA = "tensor.data and .detach() read and written in forward"
RECURRENT = "nn.LSTM, nn.GRU, nn.RNNCell"
ENCODER = "nn.TransformerEncoder, train and eval (fast path)"
INFERENCE = "inference under torch.no_grad / torch.inference_mode"
COPIES = "copies of a compiled model: deepcopy, pickle, AveragedModel"
HF = "transformers models, gradient_checkpointing_enable()"

ORDER = [LAYERS, HOOKS, BUFFERS, VIEWS, SIDE, PARAM, FUNCTION_GROUP, CHECKPOINTING, BREAKS,
         USER_AUTOCAST, DOUBLE_BACKWARD, RETAIN_GRAPH, DATA, RECURRENT, ENCODER, INFERENCE, COPIES,
         HF]
