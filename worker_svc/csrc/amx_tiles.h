/* AMX set-up shared by the AMX GEMM and the AMX prefill attention. Static in each file that
 * includes it, on purpose: a call from one of the library's files into another goes through
 * the PLT, and glibc's lazy-binding trampoline saves the extended register state into a buffer
 * sized before this process asked for the tile registers, too small for them: a crash. */
#ifndef SPLITSERVE_AMX_TILES_H
#define SPLITSERVE_AMX_TILES_H
#include <cpuid.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* 1 where the CPU has AMX-BF16 and the kernel lets this process use the tile registers. */
static inline int amx_permitted(void) {
    static int state = -1;
    if (state >= 0) return state;
    unsigned eax, ebx, ecx, edx;
    state = 0;
    if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && (edx & (1u << 22)) && (edx & (1u << 24)) &&
        syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0)
        state = 1;
    return state;
}

/* This thread's tiles: all eight 16 rows x 64 bytes. */
AMX_TARGET static inline void amx_configure_tiles(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

AMX_TARGET static inline void amx_release_tiles(void) { _tile_release(); }
#endif
