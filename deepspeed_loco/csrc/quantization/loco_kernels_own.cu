// The LoCo kernels with an exact own block (zeropp_loco_param.exact_own_block): loco_kernels.cu compiled with
// LOCO_OWN_KERNELS, which instantiates the kernels and launchers for it (and nothing else). The code that keeps an
// own block cost the kernels without one registers and spills, so they are compiled apart (the template flag Own),
// and this second translation unit lets the builder compile both halves in parallel.
#define LOCO_OWN_KERNELS
#include "loco_kernels.cu"
