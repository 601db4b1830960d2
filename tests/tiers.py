"""Which tests run where: the main tier (`./run test`, <= 10 minutes from a clean clone: the fast subset a
developer runs) and the bench tier (`./run test -m bench`). CI runs both in one pytest session
(`.ci/run`: `./run test -m "not soak"`), so a test in the bench tier is still checked on every landing.

Files named tests/test_bench_*.py are bench-tier by their own `pytestmark`. BENCH below moves single
tests (or single parametrizations, or whole files) of main-tier files to the bench tier: each entry says what
it costs (seconds on the 2-core CI VM) and what the main tier keeps of the same layer or property. A test is
moved when it is a second or third case of a property the main tier already checks, a grid, a long
end-to-end run, a run in child processes (servers, simulated devices, a second host, the deviceless GPU
compiler), or one of the server's feature files (tests/test_server.py keeps the server in the main tier).

SOAK names bench-tier tests too long for CI's 20-minute budget: full grids and tables whose scripts print
the same figures. They are marked `bench` and `soak`; CI runs `-m "not soak"`, and `./run test -m soak`
runs them by hand (before a release, or after changing what they cover).

tests/test_layers.py checks that every entry still names a test (or a file).
"""

BENCH = {
    # --- 2026-11-25 (fourth session): the main tier measured 606 s from a clean clone (1140 passed); second cases
    # out, most of them of the deprecated Triton kernels (auto picks Triton only for float32 q since issue 33)
    "tests/test_engine.py::test_preemption_keeps_outputs[1]":
        "~15 s: preemption at one step per call ([4] keeps preemption's outputs; test_chunked_prefill runs "
        "preemption at budget 4)",
    "tests/test_engine.py::test_stop_string_in_the_round_the_pool_runs_out[23]":
        "~5 s: a second stop length ([22] keeps a stop string in the round the pool runs out)",
    "tests/test_smollm2.py::test_numpy_reference_matches_transformers[chat_system]":
        "~8 s: a third prompt of the NumPy oracle (capital and chat stay)",
    "tests/test_pages.py::test_random_operation_sequences[config1]":
        "~7 s: the page allocator's random operation sequences on a second configuration (config0 keeps the "
        "property with its fixed example)",
    "tests/test_ragged.py::test_triton_forced_split_k":
        "~8 s: the deprecated Triton ragged kernel's forced split-K (test_triton_decode's forced split-K and the "
        "Mosaic ragged kernel's split-K cases stay)",
    "tests/test_ragged.py::test_triton_matches_oracle[N8K2H80S16x4-bfloat16-int8-L[1, 25, 64, 9]-sc10.0-alibi-win19-shared-Q[1, 20, 3, 9]-T36-B6]":
        "~8 s: the deprecated Triton ragged kernel with bf16 q and an int8 cache (auto sends bf16 q to Mosaic; "
        "the two float32 cases stay)",
    **{f"tests/test_triton_decode.py::test_matches_reference[{c}]": why for c, why in (
        ("N8K2H80S16x4-bfloat16-bfloat16-L[16, 17, 3, 64]-shared",
         "~4 s: the deprecated Triton decode with bf16 q (the every-feature int8 case keeps a shared page)"),
        ("N4K1H120S16x4-float16-float8_e4m3fn-L[1, 32, 50]",
         "~4 s: the deprecated Triton decode with an fp8 cache (the int8 case keeps 8-bit pages)"),
        ("N2K2H128S128x2-float16-float16-L[1, 129, 256]",
         "~4 s: the deprecated Triton decode at page 128 (the float32 case keeps several pages per sequence)"))},
    **{f"tests/test_stacked_kernels.py::test_one_layer_matches_reference_on_its_slice[{k}-bfloat16]":
       "~4 s: one layer of the stacked pool through the deprecated Triton kernel (its scan over traced layers "
       "stays and compares every layer)" for k in ("triton_decode", "triton_ragged")},
    "tests/test_sinks.py::test_ragged_kernels_interpret[triton]":
        "~4 s: sinks through the deprecated Triton ragged kernel (the Mosaic ragged kernel's case and the Triton "
        "decode's split-K case stay)",
    # --- issue 34, the GPU sampler: blocks of 16 x 4 stay in the main tier
    "tests/test_sampling_controls.py::test_gpu_candidate_sampler_draws_the_dense_samplers_tokens[4-8]":
        "4 s: the GPU sampler's candidates in blocks of 4 (the 16 x 4 case keeps both paths in the main tier)",
    # --- 2026-11-25 (third session): second cases of this session's main-tier additions
    "tests/test_ragged.py::test_mosaic_verify_rows_match_oracle[N8K2H128S16x9-bfloat16-bfloat16-L[130, 9, 40, 70, 5]-shared-sink0.5-Q[5, 1, 3, 0, 5]-T20-B6-5]":
        "4 s: the multi-row decode kernel with sinks and split-K over a 130-token sequence (the int8 / ALiBi / "
        "window case L[60, 21, 33] stays; test_ragged_lowering keeps the one-call property)",
    "tests/test_quant_hf.py::test_quantized_checkpoint_equals_numpy_dequantize_then_matmul[fp8-block]":
        "2.5 s: quant_method fp8 with weight_block_size (the compressed-tensors block layout stays, and "
        "test_head_plans_keep_checkpoint_quantization[fp8-block-4] loads this one at tp=4)",
    # --- the 4-bit dequantizing Mosaic matmul: the Q4_1 case (m_warps 1) stays in interpret mode
    **{f"tests/test_quant_gpu.py::test_kernel_in_interpret_mode_equals_numpy_dequantize_then_matmul[{c}]": why
       for c, why in (("q4_0-g128", "2 s: the Q4_0 form at 20 rows (m_warps 2)"),
                      ("f32-min-g64", "2 s: f32 minimums at 64 rows (m_warps 4)"))},
    "tests/test_quant_gpu.py::test_8bit_kernel_in_interpret_mode_equals_numpy[40-fp8]":
        "2 s: float8 values at 40 rows (the int8 case at 5 rows stays)",
    "tests/test_quant_gpu.py::test_grouped_kernel_compiles_for_h100_and_a100_and_reads_each_layer_once[subset]":
        "6 s: deviceless H100 compile of the 8-bit group-scaled kernel on Q5_K (minimums and super-block scales; "
        "test_new_8bit_formats_stay_in_the_kernel_on_a_gpu keeps the H100 routing of every new format)",
    # --- the 8-bit group-scaled kernel in interpret mode: the Q6_K case (int8 sub-scales per 16) stays
    **{f"tests/test_quant_gpu.py::test_grouped_8bit_kernel_in_interpret_mode_equals_gguf_dequantize_then_matmul[{c}]":
       why for c, why in (("Q8_0-20", "2 s: GGUF Q8_0 at 20 rows (m_warps 2)"),
                          ("Q5_K-64", "2 s: Q5_K's minimums at 64 rows (m_warps 4)"),
                          ("fp8-block-9", "2 s: block-wise FP8 codes"),
                          ("mixed-33", "2 s: mixed K-quant layers' f32 scales and minimums"))},
    "tests/test_quant_gpu.py::test_kernel_compiles_for_h100_and_a100_and_reads_each_layer_once":
        "12 s: deviceless H100 + A100 compile of the kernel in a layer scan (the interpret-mode Q4_1 case stays; "
        "tests/test_bench_quant.py compiles the engine step too)",
    # --- issue 35, row tiles (passes over 64 rows): the 100-row cases of every form stay in interpret mode
    **{f"tests/test_quant_gpu.py::test_row_tiles_in_interpret_mode_equal_numpy[{f}-200]":
       f"1.6 s: {f} at 200 rows (4 row tiles; the 100-row case keeps 2 row tiles x 2 column tiles of the form)"
       for f in ("q4_1", "int8", "Q8_0")},
    "tests/test_quant_gpu.py::test_row_tiles_compile_for_h100_and_a100_and_read_each_layer_once":
        "60 s: 6 deviceless compiles (H100 + A100, 4-bit / int8 / Q8_0 at 200 rows: 0 spills, the stack read once; "
        "the interpret-mode row-tile tests and test_kernel_serves_every_row_count_on_an_h100 stay)",
    "tests/test_quant_gpu.py::test_k_a_multiple_of_64_compiles_for_h100_and_a100_and_reads_each_layer_once":
        "~60 s: 6 deviceless compiles at K = 576 (the 64-value K step: H100 + A100, Q4_1 / int8 / Q8_0, 0 spills, "
        "the stack read once; test_k_a_multiple_of_64_in_interpret_mode_equals_numpy keeps the 64-value step's "
        "numerics and test_smollm2_linears_and_tied_head_take_the_kernel_on_an_h100_and_an_a100 its routing)",
    # --- the tied quantized head (issue 35): the deviceless compile; the traced H100 check stays
    "tests/test_tied_head.py::test_tied_head_compiles_for_h100_without_a_dense_copy":
        "20 s: deviceless H100 compile of a tied Q8_0 / int8 head, table in columns and in rows "
        "(test_tied_head_is_the_kernel_on_an_h100 keeps the head as the kernel's mma with no table-sized convert)",
    "tests/test_tied_head.py::test_tied_head_kernel_in_interpret_mode_equals_numpy[Q8_0-64]":
        "3 s: the transposed Q8_0 table at 64 rows (the 3-row Q8_0 and 20-row int8 cases stay)",
    # --- quantized layer linears under tensor parallelism (issue 35): the deviceless compile; the traced check stays
    "tests/test_quant_tp.py::test_tp_engine_step_compiles_for_two_h100s_without_a_dense_copy":
        "~80 s: deviceless compile of a small Q4_0 Llama's engine step over two H100s (17 Mosaic calls a layer body, "
        "0 spills, weights read once, none written; test_each_device_runs_the_kernel_on_its_shard_on_an_h100 keeps "
        "the kernel per shard and no dense copy in the traced step)",
    "tests/test_quant_tp.py::test_sharded_logits_equal_one_device_with_the_kernel_per_shard[2-layers-prefill]":
        "~30 s: two layers and a prefill chunk through the kernel per shard in interpret mode on 2 CPU devices "
        "([decode] keeps the sharded logits equal to one device's, every linear and the head per shard)",
    # --- Hugging Face quantized checkpoints: fp8 per channel and per tensor, AWQ, GPTQ v1 act order (asymmetric,
    # with a quantized lm_head) and pack-quantized asymmetric stay against NumPy's dequantize-then-matmul
    **{f"tests/test_quant_hf.py::test_quantized_checkpoint_equals_numpy_dequantize_then_matmul[{fmt}]": why
       for fmt, why in (("int8-channel", "2 s: int8 per channel (the fp8 per-channel case keeps the scaled path)"),
                        ("fp8-legacy", "2 s: quant_method fp8 (fp8-tensor keeps per-tensor scales)"),
                        ("gptq-sym", "3 s: GPTQ symmetric (packed-asym / awq keep both int4 forms)"),
                        ("packed", "2 s: pack-quantized symmetric (packed-asym stays)"))},
    "tests/test_quant_hf.py::test_head_plans_keep_checkpoint_quantization[gptq-actorder-4]":
        "5 s: an act-order GPTQ model's permutations at tp=4 (the awq case at tp=4 stays)",
    "tests/test_quant_hf.py::test_quantized_checkpoint_equals_numpy_dequantize_then_matmul[gptq]":
        "3 s: GPTQ v1 asymmetric in order (gptq-actorder keeps v1 zero points and the quantized lm_head)",
    "tests/test_quant_hf.py::test_quantized_checkpoint_equals_numpy_dequantize_then_matmul[gptq-v2]":
        "3 s: GPTQ v2 zero points (test_gptq_v1_zero_point_is_stored_minus_one)",
    "tests/test_quant_hf.py::test_head_plans_keep_checkpoint_quantization[fp8-channel-3]":
        "8 s: fp8 per-channel scales padded at tp=3 (the awq case at tp=4 stays)",
    # --- multihost: jpa generate over 2 processes (test_generate_over_two_processes_equals_one) stays
    "tests/test_multihost.py::test_serve_over_two_processes_and_a_hung_peer":
        "45 s: jpa serve over 2 processes, SIGSTOP of a peer; the watchdog stays in "
        "test_followers_only_follow_and_watchdog",

    # --- deviceless GPU compiles: the H100's speculative engine step, the kernel grid subset and the
    # stacked pool in a layer loop (H100 and A100) stay
    "tests/test_gpu_compile.py::test_tensor_parallel_llama70b_over_2_hosts":
        "18 s: Llama-70B-shaped TP over 2 hosts (the collectives' host classifier keeps its unit tests)",
    "tests/test_gpu_compile.py::test_random_accepted_configs_compile":
        "8 s: 6 random kernel configurations (test_kernel_grid_subset_compiles compiles the fixed subset)",

    # --- Mosaic decode in interpret mode: six cases stay (MHA page 8, GQA with a shared page, page 128,
    # every feature at once, int8 at head_dim 192, fp8 with ALiBi and a window) and one race check
    "tests/test_mosaic_decode.py::test_matches_reference[N8K1H192S32x3-float16-float16-L[33, 64, 1]]":
        "4 s: q_per_kv 8, head_dim 192 (head_dim 192 stays in the int8 case)",
    "tests/test_mosaic_decode.py::test_matches_reference[N4K2H64S64x2-bfloat16-bfloat16-L[64, 65, 127]]":
        "4 s: page 64 (pages 8, 16, 128 stay)",
    "tests/test_mosaic_decode.py::test_matches_reference[N2K1H256S16x4-bfloat16-bfloat16-L[3, 50]]":
        "4 s: head_dim 256",
    "tests/test_mosaic_decode.py::test_matches_reference[N16K1H64S16x4-bfloat16-bfloat16-L[7, 48]]":
        "3 s: q_per_kv 16",
    "tests/test_mosaic_decode.py::test_matches_reference[N4K1H96S16x4-float16-float16-L[5, 31, 48]-sc5.0]":
        "3 s: soft cap alone (the every-feature case keeps it)",
    "tests/test_mosaic_decode.py::test_matches_reference[N16K2H128S16x4-bfloat16-bfloat16-L[1, 40, 64]-alibi]":
        "3 s: ALiBi alone (every-feature and fp8 cases keep it)",
    "tests/test_mosaic_decode.py::test_matches_reference[N4K2H112S8x20-float16-float16-L[3, 20, 70, 150]-win11]":
        "5 s: a window alone (every-feature and fp8 cases keep it)",
    "tests/test_mosaic_decode.py::test_matches_reference[N6K2H64S256x1-float16-float8_e5m2-L[1, 100, 256]]":
        "4 s: an 8-bit page of 256 tokens",
    "tests/test_mosaic_decode.py::test_matches_reference[N8K2H128S32x4-bfloat16-int8-L[0, 32, 33, 100]-shared]":
        "4 s: int8 with a shared page (int8 stays at head_dim 192)",
    "tests/test_mosaic_decode.py::test_matches_reference[N4K1H64S64x2-float16-float8_e4m3fn-L[1, 64, 65]-sc20.0]":
        "3 s: e4m3 (e5m2 stays)",
    "tests/test_mosaic_decode.py::test_long_context_several_partitions_and_slots":
        "20 s: 2100 tokens in 33 partitions (test_no_races keeps multi-block partitions through the slots)",
    "tests/test_mosaic_decode.py::test_no_races[N8K1H64S32x15-float16-int8-L[450, 9]-alibi-win400]":
        "5 s: the race detector on int8 (the bf16 case stays)",

    # --- models: tiny-llama keeps each property; GPT-2 keeps its float64 reference test
    "tests/test_model.py::test_paged_decode_equals_dense_recomputation_every_step[tiny-gpt2]":
        "5 s: the GPT-2 family of a property tiny-llama keeps",
    "tests/test_model.py::test_prefill_in_two_chunks_equals_one_chunk[tiny-gpt2]":
        "7 s: the GPT-2 family of a property tiny-llama keeps",
    "tests/test_model.py::test_bfloat16_weights_and_cache_stay_close_to_float32[tiny-gpt2]":
        "7 s: the GPT-2 family of a property tiny-llama keeps",
    "tests/test_hf_models.py::test_generate_command_runs_a_checkpoint_directory":
        "8 s: jpa generate on a checkpoint folder (test_multihost runs `jpa generate --model <folder>`)",
    "tests/test_hf_models.py::test_greedy_continuation_and_paged_decode_equal_dense_every_step[gpt_oss_mxfp4]":
        "~8 s: 32 paged greedy steps of the MXFP4 gpt-oss checkpoint (its prefill logits vs transformers stay, "
        "and the float gpt-oss keeps the paged greedy steps)",
    "tests/test_hf_models.py::test_moe_grouped_matmuls_equal_the_dense_oracle_and_router_matches_numpy"
    "[1-4-True-False-blocked-float]":
        "~3 s: gpt-oss's gathered decode form in float (the MXFP4 gathered case stays)",
    "tests/test_hf_models.py::test_moe_grouped_matmuls_equal_the_dense_oracle_and_router_matches_numpy"
    "[37-4-True-False-blocked-mxfp4]":
        "~3 s: MXFP4 tiles (the float gpt-oss tiles and the MXFP4 gathered case stay)",
    "tests/test_hf_models.py::test_moe_grouped_matmuls_equal_the_dense_oracle_and_router_matches_numpy"
    "[37-4-True-False-ragged_dot-mxfp4]":
        "~3 s: MXFP4 through ragged_dot (the float ragged_dot case stays)",
    "tests/test_generate_script.py::test_compile_cache_is_on_by_default":
        "8 s: two generate processes sharing a cache folder",
    "tests/test_chunked_prefill.py::test_chunks_equal_the_reference_at_any_budget[37-5]":
        "4 s: a third budget (4 stays)",
    "tests/test_chunked_prefill.py::test_chunks_equal_the_reference_at_any_budget[64-8]":
        "8 s: a second budget (4 stays; test_engine runs every other test at budget 32)",

    # --- files n-z (measured in a 2-worker run; the kept cases are named in each line)
    "tests/test_ragged.py::test_xla_matches_oracle[N8K2H80S16x4-bfloat16-bfloat16-L[17, 40, 3]-shared-Q[1, 33, 3]-T40]":
        "~3 s: the XLA ragged path keeps 4 cases (several blocks, every feature with int8, e5m2 with a soft cap, no sequences)",
    "tests/test_ragged.py::test_xla_matches_oracle[N8K1H128S32x3-float16-float16-L[70]-Q[12]-T16-B3]":
        "~3 s: the XLA ragged path keeps 4 cases (several blocks, every feature with int8, e5m2 with a soft cap, no sequences)",
    "tests/test_ragged.py::test_xla_matches_oracle[N4K2H256S128x2-bfloat16-bfloat16-L[129, 5]-Q[3, 5]-T8]":
        "~3 s: the XLA ragged path keeps 4 cases (several blocks, every feature with int8, e5m2 with a soft cap, no sequences)",
    "tests/test_ragged.py::test_xla_matches_oracle[N9K3H64S16x4-float32-float32-L[30, 1, 45]-sc5.0-Q[25, 1, 2]-T32]":
        "~3 s: the XLA ragged path keeps 4 cases (several blocks, every feature with int8, e5m2 with a soft cap, no sequences)",
    "tests/test_ragged.py::test_xla_matches_oracle[N16K2H128S16x4-bfloat16-bfloat16-L[1, 40, 8, 64]-alibi-Q[1, 10, 0, 4]-T15]":
        "~3 s: the XLA ragged path keeps 4 cases (several blocks, every feature with int8, e5m2 with a soft cap, no sequences)",
    "tests/test_ragged.py::test_xla_matches_oracle[N4K2H96S8x5-float32-float32-L[3, 37, 40]-win11-Q[3, 20, 1]-T24]":
        "~3 s: the XLA ragged path keeps 4 cases (several blocks, every feature with int8, e5m2 with a soft cap, no sequences)",
    "tests/test_ragged.py::test_xla_matches_oracle[N4K2H64S12x4-float32-float32-L[12, 13, 35]-win5-Q[12, 1, 9]-T24]":
        "~3 s: the XLA ragged path keeps 4 cases (several blocks, every feature with int8, e5m2 with a soft cap, no sequences)",
    "tests/test_ragged.py::test_xla_matches_oracle[N8K2H80S16x4-bfloat16-int8-L[0, 17, 63]-shared-Q[0, 17, 2]-T20-B4]":
        "~3 s: the XLA ragged path keeps 4 cases (several blocks, every feature with int8, e5m2 with a soft cap, no sequences)",
    "tests/test_ragged.py::test_xla_matches_oracle[N4K1H64S16x4-float16-float8_e4m3fn-L[1, 32, 50]-Q[1, 5, 30]-T40]":
        "~3 s: the XLA ragged path keeps 4 cases (several blocks, every feature with int8, e5m2 with a soft cap, no sequences)",
    "tests/test_ragged.py::test_triton_matches_oracle[N8K2H80S16x4-bfloat16-bfloat16-L[17, 40, 3]-shared-Q[1, 33, 3]-T40]":
        "~4 s: the (deprecated) Triton ragged kernel keeps 3 cases (several blocks, every feature with int8, no sequences)",
    "tests/test_ragged.py::test_triton_matches_oracle[N8K1H128S32x3-float16-float16-L[70]-Q[12]-T16-B3]":
        "~4 s: the (deprecated) Triton ragged kernel keeps 3 cases (several blocks, every feature with int8, no sequences)",
    "tests/test_ragged.py::test_triton_matches_oracle[N4K2H256S128x2-bfloat16-bfloat16-L[129, 5]-Q[3, 5]-T8]":
        "~4 s: the (deprecated) Triton ragged kernel keeps 3 cases (several blocks, every feature with int8, no sequences)",
    "tests/test_ragged.py::test_triton_matches_oracle[N9K3H64S16x4-float32-float32-L[30, 1, 45]-sc5.0-Q[25, 1, 2]-T32]":
        "~4 s: the (deprecated) Triton ragged kernel keeps 3 cases (several blocks, every feature with int8, no sequences)",
    "tests/test_ragged.py::test_triton_matches_oracle[N4K2H64S12x4-float32-float32-L[12, 13, 35]-win5-Q[12, 1, 9]-T24]":
        "~4 s: the (deprecated) Triton ragged kernel keeps 3 cases (several blocks, every feature with int8, no sequences)",
    "tests/test_ragged.py::test_triton_matches_oracle[N8K2H80S16x4-bfloat16-int8-L[0, 17, 63]-shared-Q[0, 17, 2]-T20-B4]":
        "~4 s: the (deprecated) Triton ragged kernel keeps 3 cases (several blocks, every feature with int8, no sequences)",
    "tests/test_ragged.py::test_triton_matches_oracle[N4K1H64S16x4-float16-float8_e4m3fn-L[1, 32, 50]-Q[1, 5, 30]-T40]":
        "~4 s: the (deprecated) Triton ragged kernel keeps 3 cases (several blocks, every feature with int8, no sequences)",
    "tests/test_ragged.py::test_mosaic_matches_oracle[N8K2H128S16x4-float16-float16-L[17, 60, 3]-sc5.0-shared-Q[1, 40, 3]-T48]":
        "~5 s: the Mosaic ragged kernel keeps 4 cases (several blocks, ALiBi with a window, int8, no sequences)",
    "tests/test_ragged.py::test_mosaic_matches_oracle[N4K1H64S64x2-float16-float8_e4m3fn-L[1, 100]-win40-Q[1, 50]-T56]":
        "~5 s: the Mosaic ragged kernel keeps 4 cases (several blocks, ALiBi with a window, int8, no sequences)",
    "tests/test_ragged.py::test_mosaic_matches_oracle[N2K1H256S16x4-bfloat16-bfloat16-L[29, 5]-Q[20, 5]-T25]":
        "~5 s: the Mosaic ragged kernel keeps 4 cases (several blocks, ALiBi with a window, int8, no sequences)",
    "tests/test_triton_decode.py::test_matches_reference[N8K1H192S32x3-float16-float16-L[33, 64, 1]]":
        "~3 s: the (deprecated) Triton decode keeps 5 cases (f32, a shared bf16 page, page 128, every feature with int8, e4m3)",
    "tests/test_triton_decode.py::test_matches_reference[N8K2H256S128x2-bfloat16-bfloat16-L[128, 129, 255]]":
        "~3 s: the (deprecated) Triton decode keeps 5 cases (f32, a shared bf16 page, page 128, every feature with int8, e4m3)",
    "tests/test_triton_decode.py::test_matches_reference[N4K1H96S16x4-float32-float32-L[5, 31, 48]-sc5.0]":
        "~3 s: the (deprecated) Triton decode keeps 5 cases (f32, a shared bf16 page, page 128, every feature with int8, e4m3)",
    "tests/test_triton_decode.py::test_matches_reference[N16K2H128S16x4-bfloat16-bfloat16-L[1, 40, 64]-alibi]":
        "~3 s: the (deprecated) Triton decode keeps 5 cases (f32, a shared bf16 page, page 128, every feature with int8, e4m3)",
    "tests/test_triton_decode.py::test_matches_reference[N4K2H112S8x5-float32-float32-L[3, 20, 21, 40]-win11]":
        "~3 s: the (deprecated) Triton decode keeps 5 cases (f32, a shared bf16 page, page 128, every feature with int8, e4m3)",
    "tests/test_triton_decode.py::test_matches_reference[N8K2H80S16x4-bfloat16-int8-L[0, 17, 63]-shared]":
        "~3 s: the (deprecated) Triton decode keeps 5 cases (f32, a shared bf16 page, page 128, every feature with int8, e4m3)",
    "tests/test_triton_decode.py::test_matches_reference[N2K2H64S16x4-float32-float8_e5m2-L[16, 33, 64]-sc20.0]":
        "~3 s: the (deprecated) Triton decode keeps 5 cases (f32, a shared bf16 page, page 128, every feature with int8, e4m3)",
    "tests/test_triton_decode.py::test_matches_reference[N4K2H64S16x4-bfloat16-float32-L[9, 47]]":
        "~3 s: the (deprecated) Triton decode keeps 5 cases (f32, a shared bf16 page, page 128, every feature with int8, e4m3)",
    "tests/test_triton_decode.py::test_matches_reference[N10K2H64S16x5-float32-float32-L[7, 70]]":
        "~3 s: the (deprecated) Triton decode keeps 5 cases (f32, a shared bf16 page, page 128, every feature with int8, e4m3)",
    "tests/test_triton_decode.py::test_matches_reference[N4K2H64S12x4-float32-float32-L[12, 13, 35]]":
        "~3 s: the (deprecated) Triton decode keeps 5 cases (f32, a shared bf16 page, page 128, every feature with int8, e4m3)",
    "tests/test_triton_decode.py::test_matches_reference[N4K2H64S16x64-float32-float32-L[1024, 1023, 513]]":
        "~3 s: the (deprecated) Triton decode keeps 5 cases (f32, a shared bf16 page, page 128, every feature with int8, e4m3)",
    "tests/test_triton_decode.py::test_matches_reference[N8K2H64S32x80-bfloat16-bfloat16-L[2560, 1025, 1024, 7]-win1500]":
        "~3 s: the (deprecated) Triton decode keeps 5 cases (f32, a shared bf16 page, page 128, every feature with int8, e4m3)",
    "tests/test_triton_decode.py::test_forced_split_k[N8K2H80S8x8-bfloat16-int8-L[0, 1, 25, 64, 47]-sc10.0-alibi-win19-shared-16]":
        "10 s: forced split-K with every feature (the f32 forced split-K case stays)",
    "tests/test_triton_decode.py::test_random_lengths[41]":
        "2 s: a second seed of random lengths (seed 40 stays)",
    "tests/test_triton_decode.py::test_random_lengths[42]":
        "2 s: a third seed of random lengths (seed 40 stays)",
    "tests/test_stacked_kernels.py::test_one_layer_matches_reference_on_its_slice[triton_decode-int8]":
        "~4 s: an int8 stacked pool (bf16 of every kernel and mosaic_decode's int8 stay)",
    "tests/test_stacked_kernels.py::test_one_layer_matches_reference_on_its_slice[triton_ragged-int8]":
        "~4 s: an int8 stacked pool (bf16 of every kernel and mosaic_decode's int8 stay)",
    "tests/test_stacked_kernels.py::test_one_layer_matches_reference_on_its_slice[mosaic_ragged-int8]":
        "~4 s: an int8 stacked pool (bf16 of every kernel and mosaic_decode's int8 stay)",
    "tests/test_stacked_kernels.py::test_scan_over_layers_with_traced_layer[triton_decode-int8]":
        "~4 s: int8 in a layer scan (bf16 of every kernel stays; the int8 slice is checked one layer at a time)",
    "tests/test_stacked_kernels.py::test_scan_over_layers_with_traced_layer[mosaic_decode-int8]":
        "~4 s: int8 in a layer scan (bf16 of every kernel stays; the int8 slice is checked one layer at a time)",
    "tests/test_stacked_kernels.py::test_scan_over_layers_with_traced_layer[triton_ragged-int8]":
        "~4 s: int8 in a layer scan (bf16 of every kernel stays; the int8 slice is checked one layer at a time)",
    "tests/test_stacked_kernels.py::test_scan_over_layers_with_traced_layer[mosaic_ragged-int8]":
        "~4 s: int8 in a layer scan (bf16 of every kernel stays; the int8 slice is checked one layer at a time)",
    "tests/test_smollm2.py::test_numpy_reference_matches_transformers[unicode_code]":
        "8 s: a long prompt of the NumPy oracle (capital, chat, chat_system stay)",
    "tests/test_smollm2.py::test_numpy_reference_matches_transformers[story]":
        "5 s: a long prompt of the NumPy oracle (capital, chat, chat_system stay)",
    "tests/test_smollm2.py::test_truncated_file_raises_clear_error[98358336]":
        "6 s: a cut near the end of the 93 MB file (cuts at 10 and 1000 bytes stay)",
    "tests/test_serve_dp.py::test_two_replicas_behind_the_router":
        "30 s: 2 replicas behind vllm-router (test_a_dying_replica_stops_everything starts the same job; test_server_router routes to a server)",
    "tests/test_structured.py::test_with_speculative_decoding":
        "10 s: constraints with speculation (each alone keeps its tests; the bench tier's offload test combines them too)",
    "tests/test_gpu_compile.py::test_kernel_grid_subset_compiles[a100-kernel_names1]":
        "30 s: the A100's kernel subset (test_mosaic_ampere compiles the sm_80 Mosaic decode; the A100's stacked "
        "pool in a layer loop stays)",
    "tests/test_structured.py::test_under_preemption_with_parallel_samples":
        "40 s: constraints under preemption with n = 2 (test_random_constraints_are_met and the parallel-sampling "
        "tests keep each)",
    "tests/test_generate_script.py::test_prompt_logprobs_and_text_flags":
        "40 s: the generate command's prompt-logprob and text flags (test_jsonl_prompts_to_json_lines keeps the "
        "command; the engine's prompt logprobs keep their tests)",
    # --- a clean-clone main tier at 11 m 44 s (632 s of tests in 2 workers): more second cases out
    "tests/test_gpu_compile.py::test_stacked_pool_in_a_layer_loop_compiles[a100-kernel_names1]":
        "40 s: the A100's stacked pools in a 40-layer loop, Triton and the mma.sync Mosaic ragged op (the "
        "H100's stays; tests/test_bench_mosaic_ampere.py's ragged subset compiles the same for four targets; "
        "test_mosaic_ampere compiles the sm_80 ragged op)",
    "tests/test_gpu_compile.py::test_engine_steps_compile_with_the_targets_kernel":
        "50 s: SmolLM2's whole engine step compiled deviceless for the H100 (speculative) and the A100 (plain), "
        "both in CI's bench tier; test_dispatch's engine decode loop under jit and test_mosaic_ampere's sm_80 "
        "compile stay",
    "tests/test_server_structured.py::test_parse_with_a_pydantic_model":
        "17 s: the openai client's .parse() on chat (test_server_responses keeps .parse() on the Responses API)",
    "tests/test_prompt_logprobs.py::test_prompt_logprobs_survive_preemption_and_forks":
        "17 s: prompt logprobs under preemption (the chunked, cached-prefix and mid-prefill-preemption tests stay)",
    "tests/test_dispatch.py::test_ragged_auto_self_checks_like_decode[wrong]":
        "7 s: the ragged self-check refusing a wrong kernel (the decode self-check's wrong case and [good] stay)",
    "tests/test_sampling_controls.py::test_controls_survive_preemption_prefix_hits_and_forks":
        "10 s: penalties under preemption (the numpy reference and each control's effect stay)",
    "tests/test_speculative.py::test_draft_model_outputs_equal_without_speculation":
        "20 s: the draft-model proposer (n-gram speculation under preemption and prefix hits stays; both share the "
        "verify loop)",
    # --- this session's moves (2026-11-25)
    "tests/test_hf_models.py::test_greedy_continuation_and_paged_decode_equal_dense_every_step[gpt_oss]":
        "17 s: gpt-oss's 32 greedy tokens through paged decode (test_gpt_oss_ragged_step_equals_transformers and "
        "test_prefill_logits_match_transformers[gpt_oss] keep gpt-oss against transformers)",
    "tests/test_gpu_compile.py::test_kernel_grid_subset_compiles[h100-kernel_names0]":
        "48 s: the H100 kernel subset's compiles (test_stacked_pool_in_a_layer_loop_compiles[h100] and "
        "tests/test_traffic.py's engine step keep H100 Mosaic kernels compiled without spills)",
    "tests/test_server_toolparsers.py::test_calls_in_each_format_through_the_server[mistral]":
        "17 s: Mistral's tool-call format through a server (its parser's unit tests stay; the pythonic format "
        "keeps the server path in the main tier)",
    "tests/test_server_toolparsers.py::test_calls_in_each_format_through_the_server[qwen3_coder]":
        "14 s: Qwen3-Coder's tool-call format through a server (as above)",
    # --- the verify pass's multi-row decode kernel (issue 34): second cases
    "tests/test_ragged_lowering.py::test_mosaic_verify_rows_read_the_kv_once[4-17-2]":
        "1.3 s: rows that do not fit the q tile keep the two calls ([4-5-1] and [3-21-1] keep the one call)",
    "tests/test_mosaic_decode.py::test_matches_reference[N8K2H128S16x4-bfloat16-bfloat16-L[0, 5, 40, 64]]":
        "2.5 s: the decode kernel's one-partition epilogue for one row (test_ragged.py's verify case "
        "L[60, 21, 33] keeps it for several rows, with an 8-bit cache, ALiBi and a window)",
    # --- 2026-12-07: a clean clone's main tier took 18 m 40 s on this machine (1163 passed, pytest 996 s); second
    # cases and the longest end-to-end runs out (seconds: a loaded 3-worker run's --durations, about 1.8x quiet)
    "tests/test_model.py::test_smollm2_paged_matches_transformers_golden":
        "71 s: SmolLM2 against transformers' golden tokens through the paged model (test_smollm2's "
        "test_jpa_prefill_and_greedy_decode_match_transformers keeps the real model against transformers)",
    "tests/test_readme.py::test_readme_llm_example_runs":
        "60 s: README's LLM(...) example on SmolLM2 (test_llm, in the bench tier, keeps LLM(...) equal to the engine built by hand; "
        "test_readme_example_runs keeps README's library example)",
    "tests/test_speculative.py::test_sampled_distribution_matches_plain_sampling":
        "60 s: the token distribution with drafts (test_outputs_equal_without_speculation_under_preemption_and_"
        "prefix_hits keeps seeded samples identical with and without drafts)",
    "tests/test_chunked_prefill.py::test_preempting_prefilling_requests_keeps_outputs":
        "54 s: preemption of requests mid-prefill (test_prompt_logprobs' test_a_prompt_preempted_mid_prefill_asks_"
        "only_for_what_it_lacks preempts mid-prefill; test_chunks_equal_the_reference_at_any_budget keeps chunks)",
    "tests/test_server_router.py":
        "82 s: a server behind vllm-router (test_serve_dp's test_a_dying_replica_stops_everything starts "
        "vllm-router over replicas)",
    **{f"tests/test_serve_dp.py::test_bad_flags[{a}]": "8-13 s: one more bad serve-dp flag, a process each "
       "(--dp, a replica flag and --router-args stay)" for a in (
           "args1---port must be 0 or leave room for 2 consecutive ports",
           "args2---router-port 9001 is one of the replicas' ports 9000..9001",
           "args3-argument --policy: invalid choice: 'fastest'",
           "args5---devices-per-replica must be >= 1",
           "args7-replica flags: --model 'nope' is unknown",
           "args8-replica flags: unrecognized arguments: --no-such-flag")},
    **{f"tests/test_hf_models.py::test_greedy_continuation_and_paged_decode_equal_dense_every_step[{f}]":
       f"7-10 s: {f} (llama, gemma2 and qwen3_moe stay; each family's prefill logits against transformers stay)"
       for f in ("qwen2", "qwen3", "mistral", "mixtral")},
    "tests/test_hf_models.py::test_generate_command_runs_a_moe_checkpoint":
        "17 s: jpa generate on a MoE checkpoint folder (test_generate_script keeps the command; qwen3_moe keeps "
        "the MoE engine step)",
    **{f"tests/test_mosaic_decode.py::test_matches_reference[{c}]": why for c, why in (
        ("N8K2H128S16x6-bfloat16-bfloat16-L[16, 17, 64, 65]-shared",
         "22 s: GQA with a shared page (the every-feature case keeps a shared page)"),
        ("N2K2H80S8x5-bfloat16-bfloat16-L[0, 1, 8, 9, 40]",
         "19 s: MHA at page 8 (the every-feature case keeps head_dim 64, test_mosaic_lowering the page sizes)"),
        ("N8K2H128S128x2-float16-float16-L[128, 129, 255]",
         "18 s: page 128 (the int8 case keeps several pages per sequence; test_mosaic_lowering page 128 for H100)"))},
    "tests/test_gpu_validate.py::test_sections_are_isolated_and_the_report_is_written":
        "47 s: scripts/gpu_validate.py's sections in a CPU dry run (test_plan_lists_every_section_and_what_it_needs "
        "and test_refuses_without_a_gpu stay)",
    "tests/test_gpu_compile.py::test_stacked_pool_in_a_layer_loop_compiles[h100-kernel_names0]":
        "39 s: deviceless H100 compile of the stacked pool in a layer loop (test_traffic's "
        "test_engine_gpu_step_reads_weights_in_place compiles the engine's scanned 2-layer step for an H100 "
        "with its Mosaic kernels and no pool copy)",
    "tests/test_stacked_kernels.py::test_scan_over_layers_with_traced_layer[mosaic_decode-bfloat16]":
        "20 s: the Mosaic decode kernel scanned over layers (the Mosaic ragged kernel's scan, the engine's path, "
        "and the decode kernel's one-layer slice stay)",
    "tests/test_engine.py::test_sampling_follows_the_distribution":
        "20 s: sampled token frequencies against the model's distribution (test_sampled_logprobs_are_those_of_the_"
        "sampling_distribution and test_sampling_controls' NumPy references stay)",
    "tests/test_engine.py::test_stop_string_in_the_round_the_pool_runs_out[22]":
        "37 s: a stop string in the round the pool runs out (test_stops_on_eos_and_max_new_tokens, "
        "test_chunked_prefill's seeded sampling and stop strings and test_server's stop strings stay)",
    **{f"tests/test_ragged.py::test_mosaic_matches_oracle[{c}]": why for c, why in (
        ("N9K3H80S16x4-bfloat16-bfloat16-L[30, 1, 45]-alibi-win13-Q[25, 1, 22]-T50",
         "13 s: head_dim 80 with ALiBi and a window (the int8 case keeps the options' path; test_mosaic_ampere "
         "head_dim 80)"),
        ("N2K2H64S8x5-bfloat16-bfloat16-L[1, 9, 40, 20, 6]-Q[1, 1, 1, 7, 6]-T20-B7",
         "11 s: five sequences at page 8 (the int8 case and the empty batch stay)"))},
    "tests/test_server_structured.py::test_forced_tool_calls_validate_and_stream[required]":
        "28 s: tool_choice required (the named case stays; test_required_tools_with_local_refs keeps required)",
    "tests/test_server_toolcalls.py::test_auto_calls_stream_piece_by_piece_and_equal_the_answer[cut]":
        "22 s: auto tool calls cut by max_tokens (the whole case stays; test_server_hardening's named tool call "
        "cut by max_tokens stays)",
    "tests/test_server_reasoning.py::test_constraint_applies_to_the_answer_after_the_thought[deepseek_r1]":
        "13 s: a constraint after DeepSeek-R1's thought (the qwen3 case stays)",
    # --- 2026-12-07 (third step): the main tier measured 899 s of pytest from a clean clone, CPU-bound on 2 cores
    # with a third of its CPU in child processes; the runs that start other processes (simulated devices, a second
    # host, the deviceless GPU compiler, `jpa serve` itself) to the bench tier, each with what keeps it in process
    "tests/test_traffic.py::test_engine_gpu_step_reads_weights_in_place":
        "90 s: the engine's own step compiled deviceless for an H100, its traffic and copies (the main tier keeps "
        "test_compiled_scan_weights: stacked weights read in place in a compiled H100 scan, and test_dispatch's "
        "engine decode loop through the kernels under jit)",
    "tests/test_multihost.py::test_generate_over_two_processes_equals_one":
        "76 s: jpa generate over two processes equals one (test_followers_only_follow_and_watchdog keeps the "
        "follower loop and watchdog over two processes)",
    **{f"tests/test_tensor_parallel.py::{t}": "92 s together (tp_check.py's run on 8 simulated devices, made once "
       "for them): tiny-llama at tp 2, plain and speculative, against tp 1 (the main tier keeps the head plans, the "
       "weight rules and the padded and replicated heads computing the same function in process)"
       for t in ("test_greedy_outputs_identical_to_one_device", "test_sampled_outputs_and_logprobs_identical_to_one_device",
                 "test_speculative_decoding_under_tensor_parallelism", "test_logits_match_one_device",
                 "test_compiled_once_per_run", "test_cache_and_weight_shardings", "test_head_plans")},
    "tests/test_moe_ep.py::test_sharded_moe_mlp_equals_one_device_and_devices_hold_their_experts":
        "38 s: the expert-parallel MoE layer on simulated devices in a child process (the layout rule, its errors "
        "and the abstract model's shards stay)",
    "tests/test_server.py::test_serve_script_end_to_end":
        "37 s: `jpa serve` in a child process end to end (the in-process server tests keep every endpoint; "
        "test_packaging keeps `python -m jpa` running its commands)",
    "tests/test_server.py::test_serve_script_bad_flags":
        "12 s: `jpa serve` refusing bad flags, a process each (test_server's in-process flag checks stay)",
    "tests/test_server_hardening.py::test_sigterm_drains_then_ends_requests_with_errors":
        "35 s: SIGTERM drains `jpa serve` in a child process (test_server_hardening's child server keeps the "
        "grammar and adversarial-constraint checks)",
    "tests/test_speculative.py::test_outputs_equal_without_speculation_under_preemption_and_prefix_hits":
        "42 s: speculation under preemption and prefix hits, two engines of their own (test_speculative's "
        "one-program, abort and length-limit tests keep drafts in the engine; test_engine keeps preemption)",
    # The server's feature files (each builds its own engine behind an in-process server; the hardening file
    # also starts `jpa serve` in a child process): CI runs them with the rest of the bench tier, in the same
    # pytest session as the main tier (.ci/run). The main tier keeps tests/test_server.py (every endpoint, the
    # OpenAI client, errors, streaming, logprobs, overload) and the engine-level structured outputs
    # (tests/test_structured.py); 2026-12-07, in-worker seconds of the clean-clone run.
    "tests/test_server_structured.py":
        "76 s: structured outputs, tool calls and pydantic parsing through the server (test_structured keeps "
        "the engine's constraints; test_server the endpoints)",
    "tests/test_server_hardening.py":
        "89 s: adversarial grammars and constraints against `jpa serve` in a child process, bounded "
        "temperatures, seeds, cached tokens (test_server keeps bad requests as 400s and overload as 503s)",
    "tests/test_server_reasoning.py":
        "48 s: reasoning parsers streamed and not (test_server keeps the chat endpoint streamed and not)",
    "tests/test_server_toolcalls.py":
        "21 s (with tiny_server's engine: 42): tool calls streamed piece by piece (test_server keeps streaming)",
    "tests/test_server_limits.py::test_response_size_is_bounded_up_front":
        "11 s: n x prompt logprobs over the response bound, then under it (test_server keeps prompt_logprobs "
        "and echo; the main tier keeps the file's store, name, connection and constraint bounds)",
    "tests/test_server_limits.py::test_a_required_call_cut_by_max_tokens_is_the_same_streamed_or_not":
        "4 s: required calls cut at four max_tokens, chat and Responses, streamed and not (test_server_hardening "
        "keeps the named call cut)",
    "tests/test_server_toolparsers.py":
        "20 s: the tool-call parsers' formats through the server (test_server keeps the chat endpoint)",
    "tests/test_server_responses.py":
        "32 s: the Responses API (test_server keeps chat and completions)",
    # Child processes and deviceless GPU compiles (in-worker CPU ~0: the time is another process's)
    "tests/test_quant_tp.py::test_sharded_logits_equal_one_device_with_the_kernel_per_shard":
        "29 s: the kernel per shard on 2 simulated devices in a child process (the traced checks for two H100s "
        "stay; the compat tier runs it on JAX 0.11.2)",
    "tests/test_mosaic_ampere.py::test_ragged_op_compiles_for_an_a100_as_mma_kernels_without_spills":
        "23 s: the ragged op compiled deviceless for an A100 (the mma.sync kernels' interpret-mode cases stay; "
        "the compat tier compiles it on JAX 0.11.2)",
    "tests/test_gpu_compile.py::test_oversized_kernel_is_reported_not_crashed":
        "23 s: the compile-check tool on a kernel too big for shared memory, in a child process (the record's "
        "parsing and the plugin checks stay)",
    "tests/test_gpu_compile.py::test_a_spilling_kernel_fails_the_record":
        "17 s: the compile-check tool on a spilling kernel, in a child process (as above)",
    "tests/test_packaging.py::test_python_m_jpa_lists_and_runs_the_commands":
        "21 s: `python -m jpa` running each command in a child process (the wheel's contents and the `jpa` "
        "entry point stay)",
    "tests/test_serve_dp.py::test_a_dying_replica_stops_everything":
        "18 s: serve-dp's replicas behind vllm-router with one dying (the flag checks and device assignment stay)",
    "tests/test_server.py::test_serve_script_stops_while_loading":
        "18 s: SIGTERM to `jpa serve` while it loads, a child process (test_server's in-process lifecycle stays)",
    "tests/test_mutation_check.py::test_caught_missed_and_broken_on_a_tiny_repo":
        "12 s: the mutation tool on a tiny repository, child pytest runs (its dry run and errors stay)",
    "tests/test_hf_models.py::test_gpt_oss_ragged_step_equals_transformers":
        "9 s: gpt-oss's ragged step against transformers (its prefill logits stay)",
    **{f"tests/test_hf_models.py::test_greedy_continuation_and_paged_decode_equal_dense_every_step[{f}]":
       "8-9 s: a further family's paged greedy steps (llama's stays; every family's prefill logits stay)"
       for f in ("qwen3_moe", "gemma2")},
    # After measuring `./run test` at 662 s from a clean clone (pytest 631 s) with the moves above:
    "tests/test_engine_random.py::test_random_requests_under_page_pressure":
        "52 s: a seeded random workload with aborts and stop strings under page pressure, against the reference "
        "engine (scripts/soak_engine.py runs fresh seeds; test_engine keeps preemption, aborts and stop strings)",
    "tests/test_generate_script.py::test_jsonl_prompts_to_json_lines":
        "19 s: jpa generate's JSON-lines prompts and output, building its engine (its flag checks stay; "
        "test_llm keeps the offline API on an engine, in the bench tier)",
    "tests/test_ragged.py::test_mosaic_no_races":
        "19 s: the Mosaic ragged kernel under GPU interpret mode's race detector (test_mosaic_decode's "
        "test_no_races keeps the detector on the decode kernel's pipeline, which the ragged kernel shares)",
    "tests/test_stacked_kernels.py::test_one_layer_matches_reference_on_its_slice[mosaic_ragged-bfloat16]":
        "16 s: the Mosaic ragged kernel on one layer of a stacked pool (its traced-layer scan case stays, and the "
        "decode kernel's one-layer cases)",
    "tests/test_hf_models.py::test_gemma2_soft_caps_and_window_go_through_paged_attention":
        "16 s: Gemma-2's soft caps and window through the paged kernels' options (Gemma-2's prefill logits and "
        "chat template against transformers stay; test_decode keeps soft caps and windows in the op)",
    # After measuring `./run test` at 623 s from a clean clone (pytest 598 s, 79bb128):
    "tests/test_async_engine.py":
        "29 s, most of it its engine: the AsyncEngine's streams, aborts, idling, overload and shutdown (the main "
        "tier's tests/test_server.py drives the AsyncEngine behind every endpoint, with aborts and overload)",
    "tests/test_llm.py::test_importing_jpa_and_the_engine_does_not_import_models":
        "13 s: the import graph in a child process (tests/test_engine.py's test_engine_does_not_import_models and "
        "tests/test_layers.py's static import checks stay)",
    "tests/test_gpu_compile.py::test_a_compiler_made_after_xla_started_warns":
        "12 s: the compile-check tool's warning, in a child process (the plugin version check stays)",
    "tests/test_quant.py::test_head_plans_keep_quantized_weights_and_the_function":
        "14 s: quantized heads padded for tp=3 (tests/test_tensor_parallel.py keeps the head plans in process)",
    **{f"tests/test_engine.py::{t}": "22 s together (an engine of its own, a 40-token limit): the model's "
       "length limit and bad requests beside a good one (test_speculative keeps the length limit with and without "
       "drafts; test_server keeps bad requests as 400s)"
       for t in ("test_length_limit_of_the_model", "test_bad_requests_fail_alone")},
    # ./run test measured 643 s (pytest 617 s) from a clean clone of cf17a7e, the same tests 20 s slower than the run
    # before: this VM's noise is about 5% a run, so the main tier is taken further below the line.
    "tests/test_smollm2.py::test_numpy_reference_matches_transformers":
        "10 s, and the 19 s of dequantizing SmolLM2's GGUF to float32 for it: the independent NumPy forward against "
        "transformers (jpa's own paged model against transformers stays, as do the metadata and tokenizer tests, "
        "which read the metadata only)",
    "tests/test_smollm2.py::test_weights_have_the_documented_shapes":
        "the dequantized weights' shapes (needs the 19 s float32 read above; jpa's model built from the same file "
        "stays)",
    # ./run test measured 629 s (pytest 603 s) from a clean clone of e77d345:
    "tests/test_llm.py":
        "38 s, most of it its engine: the offline API, LLM(...) (vLLM's names, chat templates, its errors) equal "
        "to the engine built by hand (the main tier keeps the engine and the server's API)",
    **{f"tests/test_serve_dp.py::{t}": "40 s together: serve-dp refusing flags and a busy router port, a `python "
       "-m jpa serve-dp` process each (serve-dp's device assignment stays)" for t in ("test_bad_flags",
                                                                                    "test_busy_router_port")},
    "tests/test_parallel_sampling.py::test_slot_finished_at_the_fork_is_not_charged_a_copy":
        "23 s, an engine of its own (6 pages): a sample finished at the fork is not charged a page copy (n samples "
        "equal n separate requests and aborting the leader before the fork stay)",
}


SOAK = {
    # --- 2026-12-07 (fourth session): .ci/run measured 1052 s (17 m 32 s) from a clean clone on this VM; CI's own
    # machine has reported up to ~1.17x this VM's figures (1636 s for e0e3704, whose tests ran here in 1396 s at
    # e1407b2; 1666 s against 1687 s here for 2fad163): these leave CI for a margin under 20 minutes
    # (seconds: the bench tier's --durations from a clean clone, alone, under its own load)
    "tests/test_gpu_compile.py::test_a_spilling_kernel_fails_the_record":
        "32 s: a kernel made to spill fails scripts/gpu_compile_check.py's record (test_oversized_kernel_is_reported_"
        "not_crashed keeps the tool reporting a kernel that cannot compile, in CI's bench tier; the main tier's "
        "lowering tests check 0 spills)",
    "tests/test_chunked_prefill.py::test_preempting_prefilling_requests_keeps_outputs":
        "28 s: preemption of requests mid-prefill (test_prompt_logprobs' test_a_prompt_preempted_mid_prefill_asks_"
        "only_for_what_it_lacks preempts mid-prefill in the main tier)",
    "tests/test_server.py::test_serve_script_bad_flags":
        "27 s: `jpa serve` refusing bad flags, a process each (test_server's in-process flag checks stay; "
        "test_serve_script_end_to_end starts the process)",
    "tests/test_parallel_sampling.py::test_slot_finished_at_the_fork_is_not_charged_a_copy":
        "26 s: a sample finishing at the fork is not charged a copy (test_samples_stopping_together_are_released_"
        "exactly and the n-vs-separate-requests tests stay in the main tier)",
    "tests/test_bench_moe_ep.py::test_moe_layer_expert_parallel_compile_for_8_h100s":
        "23 s: the expert-parallel MoE layer compiled deviceless for 8 H100s (test_moe_ep's sharded layer on "
        "simulated devices equals one device in CI's bench tier)",
    "tests/test_engine_random.py::test_random_requests_under_page_pressure":
        "23 s: random requests under page pressure (scripts/soak_engine.py runs the same longer; test_engine, "
        "test_prefix_cache and test_speculative keep preemption and prefix hits against the reference)",
    "tests/test_readme.py::test_readme_llm_example_runs":
        "22 s: README's LLM(...) example on SmolLM2 (test_llm_equals_the_engine_built_by_hand in CI's bench tier, "
        "test_readme_example_runs in the main tier)",
    "tests/test_server_reasoning.py::test_reasoning_content_streamed_and_not[deepseek_r1]":
        "22 s: DeepSeek-R1's reasoning streamed and not (the qwen3 case stays; the parser's unit tests stay)",
    "tests/test_smollm2.py::test_weights_have_the_documented_shapes":
        "15 s: every dequantized weight's shape (the metadata tests and the real model against transformers stay)",
    "tests/test_bench_chunked.py::test_bad_flags_exit_2_with_a_message[argv0---budgets must be comma-separated integers]":
        "12 s: one more bad flag of the chunked benchmark, a process (argv4 stays in CI's bench tier)",
    "tests/test_server_router.py":
        "23 s: a server behind vllm-router (test_serve_dp's test_a_dying_replica_stops_everything starts vllm-router "
        "over replicas in CI's bench tier)",
    "tests/test_server_structured.py::test_forced_tool_calls_validate_and_stream[required]":
        "20 s: tool_choice required, streamed and not (the named case and test_required_tools_with_local_refs stay "
        "in CI's bench tier)",
    # --- 2026-12-07, fourth step: CI runs the main and bench tiers in one pytest session; to keep .ci/run near
    # 20 minutes these leave it (seconds: the bench tier's --durations from a clean clone, under the tier's load)
    "tests/test_gpu_compile.py::test_engine_steps_compile_with_the_targets_kernel[b200-mosaic_calls-plain-3]":
        "130 s: the B200's engine step compiled deviceless (the bench tier keeps test_traffic's H100 engine step, "
        "the same engine code with the Mosaic kernels; tests/test_mosaic_ampere.py lowers the ragged op for "
        "B200's sm_100; `scripts/gpu_compile_check.py` compiles every target's step)",
    "tests/test_generate_script.py::test_compile_cache_is_on_by_default":
        "34 s: jpa generate twice in child processes, the second from JAX's persistent cache (the cache flags and "
        "the generate script's outputs stay; `./run generate` runs with the cache)",
    "tests/test_server_structured.py::test_parse_with_a_pydantic_model":
        "29 s: the openai client's pydantic parse (the named forced tool call and json_schema cases stay)",
    "tests/test_chunked_prefill.py::test_chunks_equal_the_reference_at_any_budget[37-5]":
        "20 s: budget 37 with 5-row passes (budget 4 stays in the main tier; test_prompt_logprobs chunks prompts "
        "at other budgets)",
    "tests/test_server_toolcalls.py::test_auto_calls_stream_piece_by_piece_and_equal_the_answer[cut]":
        "21 s: auto tool calls cut by max_tokens (the whole case stays; a named tool call cut by max_tokens "
        "stays in test_server_hardening)",
    # --- 2026-12-07, third step: the main tier's child-process runs moved into the bench tier (above), so more of
    # the bench tier's grids go by hand (seconds: the bench tier's --durations from a clean clone, quiet)
    **{f"tests/test_mosaic_decode.py::test_matches_reference[{c}]": why for c, why in (
        ("N4K2H112S8x20-float16-float16-L[3, 20, 70, 150]-win11", "13 s: head_dim 112, 20 pages a sequence"),
        ("N6K2H64S256x1-float16-float8_e5m2-L[1, 100, 256]", "10 s: a 256-token page, fp8 e5m2"),
        ("N8K2H128S128x2-float16-float16-L[128, 129, 255]", "10 s: 128-token pages across their boundary"),
        ("N8K2H128S32x4-bfloat16-int8-L[0, 32, 33, 100]-shared", "8 s: int8 with a shared page"),
        ("N2K2H80S8x5-bfloat16-bfloat16-L[0, 1, 8, 9, 40]", "8 s: head_dim 80 at page 8"),
        ("N8K2H128S16x6-bfloat16-bfloat16-L[16, 17, 64, 65]-shared", "7 s: page-boundary lengths, shared"),
        ("N16K2H128S16x4-bfloat16-bfloat16-L[1, 40, 64]-alibi", "6 s: 16 q heads with ALiBi"),
        ("N4K1H64S64x2-float16-float8_e4m3fn-L[1, 64, 65]-sc20.0", "6 s: fp8 e4m3 with a soft cap"))
       for why in [why + " (the Mosaic decode kernel in interpret mode; the main tier keeps int8 at head_dim 192, "
                   "fp8 e5m2 with ALiBi and a window, and every option with a shared page; the bench tier the "
                   "other cases)"]},
    **{f"tests/test_ragged.py::test_mosaic_matches_oracle[{c}]": why + " (the Mosaic ragged kernel in interpret "
       "mode; the main tier keeps int8 with an empty row and the empty batch; the bench tier the head_dim 256 case)"
       for c, why in (
        ("N2K2H64S8x5-bfloat16-bfloat16-L[1, 9, 40, 20, 6]-Q[1, 1, 1, 7, 6]-T20-B7", "16 s: five sequences at page 8"),
        ("N9K3H80S16x4-bfloat16-bfloat16-L[30, 1, 45]-alibi-win13-Q[25, 1, 22]-T50", "13 s: head_dim 80, ALiBi, a window"),
        ("N8K2H128S16x4-float16-float16-L[17, 60, 3]-sc5.0-shared-Q[1, 40, 3]-T48", "12 s: float16, soft cap, shared"),
        ("N4K1H64S64x2-float16-float8_e4m3fn-L[1, 100]-win40-Q[1, 50]-T56", "9 s: fp8 e4m3 with a window"))},
    **{f"tests/test_ragged.py::test_xla_matches_oracle[{c}]": "3-5 s: a further case of the plain-JAX ragged op "
       "(its oracle test keeps four cases in the main tier: int8 with every option, float32 at page 8, fp8, empty)"
       for c in ("N4K1H64S16x4-float16-float8_e4m3fn-L[1, 32, 50]-Q[1, 5, 30]-T40",
                 "N4K2H256S128x2-bfloat16-bfloat16-L[129, 5]-Q[3, 5]-T8",
                 "N8K2H80S16x4-bfloat16-int8-L[0, 17, 63]-shared-Q[0, 17, 2]-T20-B4",
                 "N16K2H128S16x4-bfloat16-bfloat16-L[1, 40, 8, 64]-alibi-Q[1, 10, 0, 4]-T15",
                 "N8K2H80S16x4-bfloat16-bfloat16-L[17, 40, 3]-shared-Q[1, 33, 3]-T40",
                 "N8K1H128S32x3-float16-float16-L[70]-Q[12]-T16-B3")},
    **{f"tests/test_stacked_kernels.py::test_scan_over_layers_with_traced_layer[{c}]":
       "10 s: an int8 pool in the traced-layer scan (the bf16 cases of both Mosaic kernels stay; "
       "test_one_layer_matches_reference_on_its_slice keeps int8 stacked pools)" for c in ("mosaic_decode-int8", "mosaic_ragged-int8")},
    **{f"tests/test_bench_sinks.py::test_ragged_kernels_with_sinks[{c}]": "4-6 s: sinks in the deprecated Triton "
       "ragged kernel (the Mosaic cases stay; tests/test_sinks.py keeps sinks in both Triton kernels in interpret mode)" for c in (
           "N8K2H64S16x6-bfloat16-bfloat16-L[1, 40, 70, 3]-sc20.0-alibi-sink1-Q[1, 17, 30, 3]-T64-B6-triton",
           "N4K1H128S32x3-float16-float16-L[20, 90]-win25-sink-2-Q[20, 33]-T56-triton")},
    # --- 2026-12-07, second step: the bench tier measured 511 s from a clean clone (134 passed); its longest out
    # (seconds: that run's --durations, quiet)
    'tests/test_quant_tp.py::test_tp_engine_step_compiles_for_two_h100s_without_a_dense_copy[Q4_0]':
        "127 s: the deviceless compile of a Q4_0 engine step on two H100s (test_quant_tp's traced checks keep the kernel per shard, the psum and no dense copy; scripts/gpu_traffic.py --tp 2 prints the compiled step)",
    'tests/test_speculative.py::test_sampled_distribution_matches_plain_sampling':
        '67 s: the token distribution with drafts (seeded samples identical with and without drafts stay in the main tier)',
    'tests/test_structured.py::test_under_preemption_with_parallel_samples':
        "59 s: structured outputs under preemption with n > 1 (test_structured's main cases and the server's stay)",
    'tests/test_chunked_prefill.py::test_chunks_equal_the_reference_at_any_budget[64-8]':
        '48 s: a third budget (budget 4 stays in the main tier, 37 in the bench tier)',
    'tests/test_quant_tp.py::test_sharded_logits_equal_one_device_with_the_kernel_per_shard[2-layers-prefill]':
        '41 s: two layers and a prefill chunk (the decode case stays)',
    'tests/test_model.py::test_smollm2_paged_matches_transformers_golden':
        "37 s: SmolLM2's golden tokens through the paged model (test_smollm2 keeps the real model against transformers)",
    'tests/test_engine.py::test_stop_string_in_the_round_the_pool_runs_out[22]':
        '27 s: a stop string in the round the pool runs out (stop strings stay in test_engine, test_chunked_prefill and test_server)',
    'tests/test_generate_script.py::test_prompt_logprobs_and_text_flags':
        "27 s: jpa generate's prompt-logprob and text flags (test_jsonl_prompts_to_json_lines stays)",
    'tests/test_gpu_compile.py::test_stacked_pool_in_a_layer_loop_compiles[h100-kernel_names0]':
        "27 s: the H100's stacked pool in a layer loop (test_traffic's engine step compiles it)",
    'tests/test_server_reasoning.py::test_constraint_applies_to_the_answer_after_the_thought[deepseek_r1]':
        "25 s: DeepSeek-R1's thought before a constraint (qwen3 stays)",
    'tests/test_smollm2.py::test_numpy_reference_matches_transformers[story]':
        '24 s: a third prompt of the NumPy oracle',
    'tests/test_gpu_validate.py::test_sections_are_isolated_and_the_report_is_written':
        "23 s: gpu_validate.py's sections in a CPU dry run (its plan and refusal stay)",
    'tests/test_hf_models.py::test_generate_command_runs_a_moe_checkpoint':
        "22 s: jpa generate on a MoE checkpoint (qwen3_moe's engine step stays)",
    # --- 2026-12-07: .ci/run took 36 minutes from a clean clone (main 18 m 40 s, bench 11 m, compat 6 m 22 s); these
    # leave CI (seconds: a loaded 3-worker bench run's --durations, about 2.4x quiet)
    'tests/test_bench_chunked.py::test_quick_run_on_tiny_model':
        "223 s: the chunked-prefill benchmark's smoke run (scripts/bench_chunked.py prints it; test_chunked_prefill keeps chunks = reference)",
    'tests/test_gpu_compile.py::test_kernel_grid_subset_compiles[h100-kernel_names0]':
        "186 s: the H100 kernel grid subset (test_mosaic_lowering, test_ragged_lowering and test_traffic's engine step keep H100 compiles without spills)",
    'tests/test_bench_offload.py':
        '403 s: the offload benchmark and its second cases (test_kv_offload keeps swap = recompute, spills and the cost rule)',
    'tests/test_mosaic_decode.py::test_long_context_several_partitions_and_slots':
        '147 s: a long context over several partitions (the split-K cases of test_mosaic_decode and test_sinks stay)',
    'tests/test_bench_spec.py::test_tiny_run':
        "124 s: the speculation benchmark's smoke run (test_speculative keeps the outputs equal and the metrics)",
    'tests/test_structured.py::test_with_speculative_decoding':
        "105 s: structured outputs with drafts (test_structured's main cases and test_speculative stay)",
    'tests/test_quant_gpu.py::test_row_tiles_compile_for_h100_and_a100_and_read_each_layer_once':
        '102 s: deviceless H100/A100 compile of the row tiles (their interpret-mode cases stay; scripts/gpu_traffic.py compiles them)',
    'tests/test_bench_structured.py::test_quick_run_on_the_tiny_model':
        "96 s: the structured-output benchmark's smoke run",
    'tests/test_prompt_logprobs.py::test_prompt_logprobs_survive_preemption_and_forks':
        '86 s: prompt logprobs through preemption and forks (the preempted-mid-prefill case stays)',
    'tests/test_bench_compile.py::test_smallest_cpu_run':
        "80 s: the compile benchmark's smoke run (scripts/bench_compile.py)",
    'tests/test_bench_prefix.py::test_quick_run_tiny_model':
        "79 s: the prefix-cache benchmark's smoke run (test_prefix_cache stays)",
    'tests/test_engine.py::test_preemption_keeps_outputs[1]':
        '76 s: preemption at one step per call ([4] stays)',
    'tests/test_bench_parallel.py::test_quick_run_on_the_tiny_model':
        "70 s: the parallel-sampling benchmark's smoke run (test_parallel_sampling stays)",
    'tests/test_serve_dp.py::test_two_replicas_behind_the_router':
        '69 s: 2 replicas behind vllm-router (test_a_dying_replica_stops_everything stays in CI\'s bench tier)',
    'tests/test_bench_moe_hf.py::test_generate_gpt_oss_with_prefix_caching_and_ngram_speculation[gpt_oss-16]':
        '69 s: gpt-oss with prefix caching and n-gram drafts (gpt_oss_mxfp4 greedy = dense stays)',
    'tests/test_hf_models.py::test_generate_command_runs_a_checkpoint_directory':
        '69 s: jpa generate on a checkpoint folder (test_multihost runs jpa generate --model <folder>)',
    'tests/test_server_toolparsers.py::test_calls_in_each_format_through_the_server[mistral]':
        "65 s: a second tool-call format through the server (pythonic stays; every format's parser stays)",
    'tests/test_server_toolparsers.py::test_calls_in_each_format_through_the_server[qwen3_coder]':
        '45 s: a third tool-call format through the server (pythonic stays)',
    'tests/test_bench_quant.py::test_engine_on_a_quantized_checkpoint_equals_it_loaded_dense[awq]':
        "56 s: AWQ through the engine (fp8-channel stays; test_quant_hf keeps AWQ's logits)",
    'tests/test_hf_models.py::test_greedy_continuation_and_paged_decode_equal_dense_every_step[gpt_oss]':
        '44 s: gpt-oss in bf16 (gpt_oss_mxfp4 stays)',
    'tests/test_quant_gpu.py::test_kernel_compiles_for_h100_and_a100_and_reads_each_layer_once':
        "52 s: deviceless compile of the 4-bit kernel in a layer scan (test_quant_tp's bench H100 engine step and test_tied_head's compile stay)",
    'tests/test_smollm2.py::test_numpy_reference_matches_transformers[unicode_code]':
        '50 s: a fourth prompt of the NumPy oracle',
    'tests/test_gpu_compile.py::test_stacked_pool_in_a_layer_loop_compiles[a100-kernel_names1]':
        "46 s: the A100's stacked pool in a layer loop (test_mosaic_ampere keeps the A100's ragged op compile)",
    'tests/test_engine.py::test_stop_string_in_the_round_the_pool_runs_out[23]':
        '36 s: a second stop length',
    'tests/test_quant_gpu.py::test_k_a_multiple_of_64_compiles_for_h100_and_a100_and_reads_each_layer_once':
        '35 s: deviceless compile of the K tail (its interpret-mode cases stay)',
    'tests/test_bench_quant_gpu_k.py':
        "32 s: Q4_K's deviceless compile (its interpret-mode case stays)",
    'tests/test_triton_decode.py::test_forced_split_k[N8K2H80S8x8-bfloat16-int8-L[0, 1, 25, 64, 47]-sc10.0-alibi-win19-shared-16]':
        "11 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_triton_decode.py::test_matches_reference[N10K2H64S16x5-float32-float32-L[7, 70]]':
        "8 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_triton_decode.py::test_matches_reference[N16K2H128S16x4-bfloat16-bfloat16-L[1, 40, 64]-alibi]':
        "10 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_triton_decode.py::test_matches_reference[N2K2H128S128x2-float16-float16-L[1, 129, 256]]':
        "6 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_triton_decode.py::test_matches_reference[N2K2H64S16x4-float32-float8_e5m2-L[16, 33, 64]-sc20.0]':
        "11 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_triton_decode.py::test_matches_reference[N4K1H120S16x4-float16-float8_e4m3fn-L[1, 32, 50]]':
        "10 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_triton_decode.py::test_matches_reference[N4K1H96S16x4-float32-float32-L[5, 31, 48]-sc5.0]':
        "9 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_triton_decode.py::test_matches_reference[N4K2H112S8x5-float32-float32-L[3, 20, 21, 40]-win11]':
        "7 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_triton_decode.py::test_matches_reference[N4K2H64S12x4-float32-float32-L[12, 13, 35]]':
        "7 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_triton_decode.py::test_matches_reference[N4K2H64S16x4-bfloat16-float32-L[9, 47]]':
        "8 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_triton_decode.py::test_matches_reference[N4K2H64S16x64-float32-float32-L[1024, 1023, 513]]':
        "6 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_triton_decode.py::test_matches_reference[N8K1H192S32x3-float16-float16-L[33, 64, 1]]':
        "6 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_triton_decode.py::test_matches_reference[N8K2H256S128x2-bfloat16-bfloat16-L[128, 129, 255]]':
        "7 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_triton_decode.py::test_matches_reference[N8K2H64S32x80-bfloat16-bfloat16-L[2560, 1025, 1024, 7]-win1500]':
        "12 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_triton_decode.py::test_matches_reference[N8K2H80S16x4-bfloat16-bfloat16-L[16, 17, 3, 64]-shared]':
        "8 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_triton_decode.py::test_matches_reference[N8K2H80S16x4-bfloat16-int8-L[0, 17, 63]-shared]':
        "10 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_triton_decode.py::test_random_lengths[41]':
        "10 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_triton_decode.py::test_random_lengths[42]':
        "7 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_ragged.py::test_triton_forced_split_k':
        "9 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_ragged.py::test_triton_matches_oracle[N4K1H64S16x4-float16-float8_e4m3fn-L[1, 32, 50]-Q[1, 5, 30]-T40]':
        "15 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_ragged.py::test_triton_matches_oracle[N4K2H256S128x2-bfloat16-bfloat16-L[129, 5]-Q[3, 5]-T8]':
        "12 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_ragged.py::test_triton_matches_oracle[N4K2H64S12x4-float32-float32-L[12, 13, 35]-win5-Q[12, 1, 9]-T24]':
        "11 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_ragged.py::test_triton_matches_oracle[N8K1H128S32x3-float16-float16-L[70]-Q[12]-T16-B3]':
        "13 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_ragged.py::test_triton_matches_oracle[N8K2H80S16x4-bfloat16-bfloat16-L[17, 40, 3]-shared-Q[1, 33, 3]-T40]':
        "16 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_ragged.py::test_triton_matches_oracle[N8K2H80S16x4-bfloat16-int8-L[0, 17, 63]-shared-Q[0, 17, 2]-T20-B4]':
        "13 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_ragged.py::test_triton_matches_oracle[N8K2H80S16x4-bfloat16-int8-L[1, 25, 64, 9]-sc10.0-alibi-win19-shared-Q[1, 20, 3, 9]-T36-B6]':
        "20 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_ragged.py::test_triton_matches_oracle[N9K3H64S16x4-float32-float32-L[30, 1, 45]-sc5.0-Q[25, 1, 2]-T32]':
        "12 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_stacked_kernels.py::test_one_layer_matches_reference_on_its_slice[triton_decode-bfloat16]':
        "8 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_stacked_kernels.py::test_one_layer_matches_reference_on_its_slice[triton_decode-int8]':
        "12 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_stacked_kernels.py::test_one_layer_matches_reference_on_its_slice[triton_ragged-bfloat16]':
        "23 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_stacked_kernels.py::test_one_layer_matches_reference_on_its_slice[triton_ragged-int8]':
        "21 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_stacked_kernels.py::test_scan_over_layers_with_traced_layer[triton_decode-int8]':
        "7 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_stacked_kernels.py::test_scan_over_layers_with_traced_layer[triton_ragged-int8]':
        "14 s: the deprecated Triton kernels' second cases (each keeps a case in the main tier)",
    'tests/test_bench_chunked.py::test_bad_flags_exit_2_with_a_message[argv1---budgets must name at least one budget >= 1]':
        '17 s: a second bench_chunked bad flag (argv0 stays)',
    'tests/test_bench_chunked.py::test_bad_flags_exit_2_with_a_message[argv2---long-max (800) must be >= --long-min (900)]':
        '17 s: a second bench_chunked bad flag (argv0 stays)',
    'tests/test_bench_chunked.py::test_bad_flags_exit_2_with_a_message[argv3---max-seqs (8) must hold --num-short + --num-long (10)]':
        '15 s: a second bench_chunked bad flag (argv0 stays)',
    'tests/test_mosaic_decode.py::test_no_races[N8K1H64S32x15-float16-int8-L[450, 9]-alibi-win400]':
        '27 s: a second race check (the shared-page case stays)',
    'tests/test_smollm2.py::test_truncated_file_raises_clear_error[98358336]':
        '27 s: a second truncation point (the others stay)',
    'tests/test_pages.py::test_random_operation_sequences[config1]':
        '25 s: a second configuration (config0 stays)',
    # --- 2026-11-25 (fourth session): room in CI's bench tier for the main tier's second cases above
    "tests/test_sampling_controls.py::test_controls_survive_preemption_prefix_hits_and_forks":
        "25-60 s: penalties under preemption, prefix hits and forks (the main tier keeps the numpy reference of "
        "each control and its effect; the bench tier keeps structured outputs and prompt logprobs under preemption)",
    "tests/test_quant_gpu.py::test_grouped_kernel_compiles_for_h100_and_a100_and_reads_each_layer_once[grid]":
        "3 min: the 8-bit group-scaled kernel's 21 deviceless compiles (4 formats x 16 / 32 / 64 rows, H100 and "
        "A100; the bench tier keeps a 3-compile subset)",
    # --- 2026-11-25 (third session): the bench tier measured 724 s from a clean clone; the longest compiles out
    "tests/test_bench_mosaic_ampere.py::test_ragged_subset_compiles_for_ampere_ada_and_blackwell[b200-sm_100a]":
        "100-170 s: B200's ragged subset, now with 8-bit caches (the bench tier keeps B200's whole engine step, "
        "test_engine_steps_compile_with_the_targets_kernel[b200-...], with the Mosaic decode and ragged kernels)",
    "tests/test_gpu_compile.py::test_engine_steps_compile_with_the_targets_kernel[h100-mosaic_calls-spec-4]":
        "60-160 s: the H100's speculative engine step (4 Mosaic calls: the verify pass's one multi-row call); "
        "test_ragged_lowering's test_mosaic_verify_rows_read_the_kv_once keeps the one call in the main tier, "
        "test_traffic the H100's plain step read in place, and the bench tier the H100 kernel subset",
    "tests/test_bench_offload.py::test_offload_compile_check_h100":
        "115 s: scripts/offload_compile_check.py for an H100 (test_kv_offload's "
        "test_offload_programs_place_and_alias keeps the placement and aliasing on the CPU backend)",
    "tests/test_multihost.py::test_mixture_of_experts_over_two_processes_equals_one":
        "about 1 min: a mixture of experts at tp=4 over 2 processes (tests/test_moe_ep.py keeps the sharded "
        "experts vs one device on simulated devices; test_generate_over_two_processes_equals_one keeps the "
        "multi-process engine)",
    **{f"tests/test_bench_quant.py::test_engine_gpu_step_reads_4bit_weights_once_without_a_dense_copy[{q}]":
       "40 s: the engine's unified step of a 2-layer Llama with 4-bit weights compiled for an H100 (the bench "
       "tier keeps tests/test_quant_gpu.py's kernel compile in a layer scan, H100 + A100, no weight written)"
       for q in ("Q4_1", "gptq")},
    "tests/test_bench_quant.py::test_engine_gpu_prompt_pass_over_64_rows_reads_4bit_weights_once":
        "90 s: the same engine step at a 256-token budget (the prompt pass through the kernel's row tiles; the "
        "main tier keeps the row tiles in interpret mode and test_kernel_serves_every_row_count_on_an_h100)",
    "tests/test_bench_traffic.py":
        "6 min: the Llama-8B traffic tables, XLA's default and the engine's options, the speculative step's "
        "sampler passes (issue 34; test_traffic keeps the small step's in the bench tier), and the small engine step "
        "under XLA's default (scripts/gpu_traffic.py prints them; tests/test_traffic.py keeps the model's "
        "accounting on a known program and the engine's own small step read in place in the main tier)",
    "tests/test_bench_mosaic_ampere.py::test_grid_matches_reference":
        "2 min: the Ampere decode's interpret grid (tests/test_mosaic_ampere.py keeps both copy paths; the "
        "bench tier keeps the kernel subset's compile for four targets)",
    "tests/test_bench_mosaic_ampere.py::test_ragged_grid_matches_reference":
        "2 min: the mma.sync ragged op's interpret grid on both copy paths (tests/test_mosaic_ampere.py keeps "
        "the cp.async path with every row option; the bench tier keeps the stacked pool on both paths and "
        "the ragged subset's compile for four targets)",
    "tests/test_bench_sinks.py::test_decode_kernels_with_sinks":
        "1 min: 3 decode kernels x 6 cases with sinks (tests/test_sinks.py keeps each kernel with split-K)",
    "tests/test_bench_quant.py::test_engine_greedy_tokens_and_logprobs_equal_the_dequantized_model":
        "1 min: two engine compiles (tests/test_quant.py keeps the quantized model against its dequantized weights)",
    "tests/test_bench_offload.py::test_swap_with_speculation_and_prompt_logprobs":
        "1 min: offload with speculation (tests/test_kv_offload.py keeps swap = recompute with prefix hits and n = 2)",
    "tests/test_bench_offload.py::test_swap_with_structured_outputs_and_parallel_samples":
        "1 min: offload with structured outputs (tests/test_kv_offload.py keeps swap = recompute)",
    "tests/test_bench_quant.py::test_quantized_checkpoints_of_every_family":
        "4 min: AWQ / FP8 / pack-quantized checkpoints of qwen2, qwen3, mistral and gemma2 through the engine "
        "(tests/test_quant_hf.py keeps every format against numpy on llama; the bench tier keeps the engine on "
        "AWQ and FP8)",
    "tests/test_bench_quant.py::test_engine_on_a_quantized_checkpoint_equals_it_loaded_dense[gptq]":
        "25 s: GPTQ through the engine (tests/test_quant_hf.py keeps GPTQ's logits against numpy)",
    "tests/test_bench_quant.py::test_engine_on_a_quantized_checkpoint_equals_it_loaded_dense[gptq-actorder]":
        "25 s: GPTQ act order through the engine (tests/test_quant_hf.py keeps its logits against numpy)",
    "tests/test_bench_quant.py::test_engine_on_a_quantized_checkpoint_equals_it_loaded_dense[packed-asym]":
        "25 s: pack-quantized int4 through the engine (tests/test_quant_hf.py keeps its logits against numpy)",
    "tests/test_bench_mosaic_ampere.py::test_kernel_subset_compiles_for_ampere_ada_and_blackwell[a6000-sm_86]":
        "the A6000's decode subset (A100 and B200 stay in the bench tier; sm_86 is the A100's code path)",
    "tests/test_bench_mosaic_ampere.py::test_kernel_subset_compiles_for_ampere_ada_and_blackwell[l4-sm_89]":
        "the L4's decode subset (A100 and B200 stay in the bench tier)",
    "tests/test_bench_mosaic_ampere.py::test_ragged_subset_compiles_for_ampere_ada_and_blackwell[a6000-sm_86]":
        "the A6000's ragged subset (A100 and B200 stay in the bench tier)",
    "tests/test_bench_mosaic_ampere.py::test_ragged_subset_compiles_for_ampere_ada_and_blackwell[l4-sm_89]":
        "the L4's ragged subset (A100 and B200 stay in the bench tier)",
    "tests/test_bench_mosaic_ampere.py::test_kernel_subset_compiles_for_ampere_ada_and_blackwell[rtx6000pro-sm_120a]":
        "the RTX PRO 6000's decode subset (sm_120 runs B200's TMA code path; B200's ragged subset stays in the "
        "bench tier)",
    "tests/test_bench_mosaic_ampere.py::test_ragged_subset_compiles_for_ampere_ada_and_blackwell[rtx6000pro-sm_120a]":
        "the RTX PRO 6000's ragged subset (B200's, the same TMA code path, stays in the bench tier)",
    "tests/test_bench_moe_hf.py::test_generate_gpt_oss_with_prefix_caching_and_ngram_speculation[gpt_oss_mxfp4-24]":
        "60 s: jpa generate on the MXFP4 gpt-oss (the bf16 one stays in the bench tier; the main tier keeps "
        "MXFP4's prefill logits against transformers)",
    "tests/test_bench_moe_ep.py::test_engine_greedy_tokens_and_logprobs_under_expert_parallelism":
        "5 min: the engine at tp = 1, 2, 4 (and 2 with n-gram speculation) on Qwen3-MoE and gpt-oss MXFP4, 8 engine "
        "compiles (the main tier keeps Qwen3-MoE's whole-model prefill logits at EP=2 and the sharded MoE MLP "
        "against one device in both layouts)",
    "tests/test_bench_moe_ep.py::test_model_logits_under_expert_parallelism":
        "20-25 s: gpt-oss MXFP4's whole-model prefill and decode logits at EP=4 (the main tier keeps Qwen3-MoE's "
        "whole-model prefill logits at EP=2 and the sharded MoE MLP in both layouts)",
    "tests/test_bench_moe_ep.py::test_moe_tp_compiles_of_the_large_shapes":
        "2-3 min each: Qwen3-30B-A3B and gpt-oss-120b shapes on 8 H100s, deviceless (the bench tier keeps the tiny "
        "MoE's expert-parallel compile with the same checks)",
    "tests/test_bench_decode_pad.py":
        "1-2 min: the idle decode row of max_seqs 1 on GPU changes no output, run on the CPU (tests/test_traffic.py "
        "keeps the GPU step's weights in place)",
    "tests/test_bench_offload.py::test_generate_summary_line_has_offload":
        "1 min: jpa generate's offload summary line (tests/test_kv_offload.py keeps the offload metrics)",
    # --- out of CI's bench tier to keep .ci/run within 20 minutes (2026-11-25; seconds measured in the bench
    # tier at 3 workers): each keeps a case in the main or bench tier
    "tests/test_bench_mosaic_ampere.py::test_ragged_subset_compiles_for_ampere_ada_and_blackwell[a100-sm_80]":
        "55 s: the A100's ragged subset (tests/test_mosaic_ampere.py compiles the ragged op for an A100, both "
        "kernels at sm_80 without spills; the bench tier keeps B200's subset)",
    "tests/test_bench_mosaic_ampere.py::test_kernel_subset_compiles_for_ampere_ada_and_blackwell[a100-sm_80]":
        "38 s: the A100's decode subset (the main tier's A100 ragged-op compile holds the decode kernel)",
    "tests/test_bench_mosaic_ampere.py::test_kernel_subset_compiles_for_ampere_ada_and_blackwell[b200-sm_100a]":
        "42 s: B200's decode subset (the bench tier's B200 ragged subset holds the decode kernel)",
    "tests/test_gpu_compile.py::test_kernel_grid_subset_compiles[a100-kernel_names1]":
        "39 s: the A100's kernel subset (the main tier's A100 ragged-op compile; the bench tier keeps the H100's)",
    "tests/test_gpu_compile.py::test_random_accepted_configs_compile":
        "24 s: 6 random kernel configurations (the bench tier keeps the fixed H100 subset)",
    "tests/test_gpu_compile.py::test_tensor_parallel_llama70b_over_2_hosts":
        "48 s: Llama-70B-shaped TP over 2 hosts (the collectives' host classifier keeps its unit tests)",
    "tests/test_gpu_compile.py::test_engine_steps_compile_with_the_targets_kernel[a100-mosaic_calls-plain-3]":
        "39 s: the A100's engine step (the bench tier keeps B200's engine step and test_traffic's H100 plain "
        "step read in place; test_mosaic_ampere the A100's kernels)",
    "tests/test_bench_offload.py::test_offload_soak_short":
        "45 s: a short soak with offload (scripts/soak_engine.py --kv-offload-memory; the bench tier keeps "
        "on = off under speculation, the main tier the multi-turn spill and swap = recompute)",
    "tests/test_bench_offload.py::test_on_off_identical_under_structured_outputs":
        "17 s: offload on = off with structured outputs (the bench tier keeps it under speculation)",
    "tests/test_bench_tp_hf.py":
        "72 s: Gemma-2 and Qwen3 under tensor parallelism (tests/test_tensor_parallel.py keeps tiny-llama and "
        "tiny-gpt2 at tp 2)",
    "tests/test_multihost.py::test_serve_over_two_processes_and_a_hung_peer":
        "43 s: jpa serve over 2 processes with a SIGSTOPped peer (test_followers_only_follow_and_watchdog keeps "
        "the watchdog)",
    "tests/test_bench_lmeval.py":
        "54 s: lm-eval against jpa serve (the main tier's server tests keep the completions API)",
    "tests/test_bench_dp.py":
        "61 s: bench_dp.py's smoke run (tests/test_serve_dp.py keeps two replicas behind the router)",
    "tests/test_bench_multihost.py":
        "61 s: bench_multihost.py's smoke run (tests/test_multihost.py keeps generate over two processes, in the bench tier)",
}


# The test files that keep a worker busiest, started first: `./run test` hands whole files (or SHARED groups)
# to its workers in collection order (tests/conftest.py's scheduler), so a long file collected last would run
# alone at the end while the others idle. tests/conftest.py sorts them to the front, in this order (the main
# tier's longest in a clean-clone run of 2026-12-07, in-worker seconds).
SLOW_FIRST = ("tests/test_engine.py", "tests/test_dispatch.py", "tests/test_server.py", "tests/test_server_hardening.py",
              "tests/test_ragged.py", "tests/test_step_contract.py",
              "tests/test_hf_models.py", "tests/test_sampling_controls.py", "tests/test_server_structured.py",
              "tests/test_smollm2.py", "tests/test_pages.py", "tests/test_model.py", "tests/test_tensor_parallel.py",
              "tests/test_gpu_compile.py", "tests/test_multihost.py", "tests/test_speculative.py",
              "tests/test_structured.py", "tests/test_chunked_prefill.py", "tests/test_llm.py")

# Files whose tests build engines of the same configurations: a worker compiles a step program once and every
# later engine of that program in the process reuses it (jpa.engine.runner.STEP_EXECUTABLES), so each group runs
# in one worker (tests/conftest.py's scheduler) instead of each worker that meets a file compiling the same
# programs. "engines": conftest's `engines` (its REFERENCE, BASE and tight pools, budgets 32 and 4); "tiny_server":
# tests/server_util.tiny_server's engine. In a clean-clone run of 2026-12-07 the reference program was compiled by
# three workers, the base one by three, the tight one by two, tiny_server's by three.
SHARED = {
    # Two groups, not one: as one unit of ~460 s they were the main tier's long pole (./run test stayed at ~600 s of
    # pytest while the other workers' files were trimmed); each group compiles the reference program once.
    "engines": ("tests/test_engine.py", "tests/test_chunked_prefill.py", "tests/test_prefix_cache.py",
                "tests/test_structured.py", "tests/test_parallel_sampling.py"),
    "engines_b": ("tests/test_speculative.py", "tests/test_kv_offload.py", "tests/test_prompt_logprobs.py",
                  "tests/test_dispatch.py"),
    "tiny_server": ("tests/test_server_toolcalls.py", "tests/test_server_responses.py",
                    "tests/test_server_toolparsers.py"),
}


def scope(nodeid: str) -> str:
    """The unit of work a worker gets nodeid in: its SHARED group's name, or its file."""
    path = nodeid.split("::", 1)[0]
    return next((name for name, files in SHARED.items() if path in files), path)


def slow_first(nodeid: str) -> int:
    """Sort key: the position of nodeid's file in SLOW_FIRST, or after all of them."""
    path = nodeid.split("::", 1)[0]
    return SLOW_FIRST.index(path) if path in SLOW_FIRST else len(SLOW_FIRST)


def moved(nodeid: str, table: dict = BENCH) -> bool:
    """Whether nodeid (`path::test` or `path::test[param]`) is named by an entry of table (its id, its
    test, or its file)."""
    base = nodeid.split("[", 1)[0]
    return nodeid in table or base in table or base.split("::", 1)[0] in table
