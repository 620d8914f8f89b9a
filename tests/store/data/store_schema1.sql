--
-- PostgreSQL database dump
--

\restrict LhBKHs6guxB0QHa4yfnkfDGkHyjRaOm1qxBo4YOjhjsmhCajo5ve6ZZfVgi1AoD

-- Dumped from database version 15.18 (Debian 15.18-0+deb12u1)
-- Dumped by pg_dump version 15.18 (Debian 15.18-0+deb12u1)

SET statement_timeout = 0;
SET lock_timeout = 0;
SET idle_in_transaction_session_timeout = 0;
SET client_encoding = 'UTF8';
SET standard_conforming_strings = on;
SELECT pg_catalog.set_config('search_path', '', false);
SET check_function_bodies = false;
SET xmloption = content;
SET client_min_messages = warning;
SET row_security = off;

SET default_tablespace = '';

SET default_table_access_method = heap;

--
-- Name: autotune_claims; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.autotune_claims (
    fingerprint character varying(64) NOT NULL,
    owner character varying(200) NOT NULL,
    claimed_at double precision NOT NULL,
    expires_at double precision NOT NULL
);


--
-- Name: autotune_entries; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.autotune_entries (
    fingerprint character varying(64) NOT NULL,
    workload character varying(200) NOT NULL,
    device character varying(300) NOT NULL,
    device_kind character varying(16) NOT NULL,
    estimated boolean NOT NULL,
    max_micro_batch integer NOT NULL,
    max_batch integer NOT NULL,
    limited_by character varying(16) NOT NULL,
    created_at double precision NOT NULL,
    hits integer NOT NULL,
    last_hit_at double precision,
    invalidated_at double precision,
    invalid_reason text,
    components text NOT NULL,
    probe text NOT NULL,
    autotune_version character varying(32) NOT NULL
);


--
-- Name: autotune_measurements; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.autotune_measurements (
    id integer NOT NULL,
    fingerprint character varying(64) NOT NULL,
    recorded_at double precision NOT NULL,
    source character varying(16) NOT NULL,
    device character varying(300) NOT NULL,
    device_kind character varying(16) NOT NULL,
    batch integer NOT NULL,
    peak_reserved_bytes bigint,
    peak_allocated_bytes bigint,
    estimated_peak_bytes bigint,
    oom boolean NOT NULL,
    retries integer NOT NULL,
    throughput double precision,
    seconds double precision,
    note text
);


--
-- Name: autotune_measurements_id_seq; Type: SEQUENCE; Schema: public; Owner: -
--

CREATE SEQUENCE public.autotune_measurements_id_seq
    AS integer
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;


--
-- Name: autotune_measurements_id_seq; Type: SEQUENCE OWNED BY; Schema: public; Owner: -
--

ALTER SEQUENCE public.autotune_measurements_id_seq OWNED BY public.autotune_measurements.id;


--
-- Name: autotune_plans; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.autotune_plans (
    id integer NOT NULL,
    fingerprint character varying(64) NOT NULL,
    key character varying(100) NOT NULL,
    target_batch integer NOT NULL,
    world_size integer NOT NULL,
    created_at double precision NOT NULL,
    plan text NOT NULL
);


--
-- Name: autotune_plans_id_seq; Type: SEQUENCE; Schema: public; Owner: -
--

CREATE SEQUENCE public.autotune_plans_id_seq
    AS integer
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;


--
-- Name: autotune_plans_id_seq; Type: SEQUENCE OWNED BY; Schema: public; Owner: -
--

ALTER SEQUENCE public.autotune_plans_id_seq OWNED BY public.autotune_plans.id;


--
-- Name: autotune_store_info; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.autotune_store_info (
    key character varying(64) NOT NULL,
    value character varying(200) NOT NULL
);


--
-- Name: autotune_measurements id; Type: DEFAULT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.autotune_measurements ALTER COLUMN id SET DEFAULT nextval('public.autotune_measurements_id_seq'::regclass);


--
-- Name: autotune_plans id; Type: DEFAULT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.autotune_plans ALTER COLUMN id SET DEFAULT nextval('public.autotune_plans_id_seq'::regclass);


--
-- Data for Name: autotune_claims; Type: TABLE DATA; Schema: public; Owner: -
--



--
-- Data for Name: autotune_entries; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.autotune_entries VALUES ('b20792745014d76fd695a6dc1408a3c26e4f2dfdc3ae06afd201a6122956c9c5', 'mlp', 'estimate for a CUDA GPU with 1.0 GiB, compute capability 8.0', 'estimate', true, 512, 512, 'max_batch', 1796338516.1689136, 1, 1796338516.1972167, NULL, NULL, '{"alloc_conf": "", "autotune": "0.1.0", "batch": {"2": {"leaves": [{"dtype": "torch.float32", "tensor": [2, 64]}, {"dtype": "torch.int64", "tensor": [2]}], "structure": "TreeSpec(tuple, None, [*, *])"}, "3": {"leaves": [{"dtype": "torch.float32", "tensor": [3, 64]}, {"dtype": "torch.int64", "tensor": [3]}], "structure": "TreeSpec(tuple, None, [*, *])"}}, "device": {"allowance_bytes": 671088640, "budget_bytes": 1073741824, "capacity_bytes": 402653184, "compute_capability": "8.0", "cpu_count": null, "cuda_like": true, "driver": null, "engine": "meta", "estimated": true, "kind": "estimate", "measured_by": "reserved peak of a simulated CUDA caching allocator replaying the allocations of meta tensors (no real compute)", "model": null, "name": "estimate", "ram_total_bytes": null, "round_to": 1, "total_bytes": 1073741824}, "fit_rule": {"holds": {"loss_sum": true, "noise_buffer": 257}, "micro_steps": 2, "optimizer_steps": 2}, "margin": 0.1, "model": {"buffers": 0, "class": "torch.nn.modules.container.Sequential", "digest": "1d6aa2eeb3bd22018f9901d9e9cc2b8fd4aebf832d838dbe3e17d7fa4065d11a", "dtypes": ["torch.float32"], "modules": 6, "parameter_bytes": 340008, "parameters": 85002}, "ops": {"count": 49, "digest": "4b392ab6f33164c372c25d495829e6a506c2d06554c4f98731f502ab4699c69b", "engine": "meta", "traced": true}, "optimizer": {"class": "torch.optim.adamw.AdamW", "defaults": {"amsgrad": false, "betas": [0.9, 0.999], "capturable": false, "decoupled_weight_decay": true, "differentiable": false, "eps": 1e-08, "foreach": null, "fused": null, "lr": 0.001, "maximize": false, "weight_decay": 0.01}, "param_groups": [{"amsgrad": false, "betas": [0.9, 0.999], "capturable": false, "decoupled_weight_decay": true, "differentiable": false, "eps": 1e-08, "foreach": true, "fused": null, "lr": 0.001, "maximize": false, "numel": 85002, "params": 6, "weight_decay": 0.01}]}, "parallel": "ddp", "precision": "fp32", "rule": {"data_parallel": false}, "torch": "2.13.0+cpu", "workload": {"name": "mlp", "options": {}}, "world_size": 1}', '{"alloc_retries": 0, "allocated_peak_bytes": 21688832, "breakdown": {"activations": 2233388, "gradients": 340008, "optimizer_state": 680040, "parameters": 340008}, "capacity_bytes": 402653184, "curve": [[1, 25165824], [2, 25165824], [3, 25165824], [17, 25165824], [34, 25202424], [50, 25255800], [66, 25309176], [83, 25365888], [99, 25419264], [115, 25472640], [132, 25529352], [148, 25582728], [164, 25636104], [181, 25692816], [197, 25746192], [213, 25799568], [229, 25852944], [246, 25909656], [262, 26172976], [278, 26242736], [295, 26316856], [311, 26386616], [327, 26456376], [344, 26530496], [360, 26600256], [376, 26670016], [393, 26744136], [409, 26813896], [425, 26883656], [442, 26957776], [458, 27027536], [474, 27097296], [491, 27171416], [507, 27241176], [512, 27262976], [523, 27310936], [540, 27385056], [556, 27454816], [572, 27524576], [588, 27594336], [605, 27668456], [621, 27738216], [637, 27807976], [654, 27882096], [670, 27951856], [686, 28021616], [703, 28095736], [719, 28165496], [735, 28235256], [752, 28309376], [768, 28379136]], "curve_lines": [[25370648.0, 0.0], [25370608.0, 0.0], [25360368.0, 0.0], [25359344.0, 0.0], [25293824.0, 3336.0], [25292800.0, 3336.0], [25040936.0, 3376.0], [25040896.0, 3376.0], [25030656.0, 4360.0], [24700928.0, 4360.0], [24350616.0, 4360.0], [24020888.0, 4360.0]], "data_parallel": false, "device": {"allocator_conf": "", "allocator_conf_variable": null, "allowance_bytes": 671088640, "budget_bytes": 1073741824, "capacity_bytes": 402653184, "capacity_source": "memory budget less the CUDA context allowance", "compute_capability": "8.0", "cpu_count": null, "cuda_like": true, "driver": null, "engine": "meta", "engine_fallback": null, "estimated": true, "free_bytes": null, "kind": "estimate", "measured_by": "reserved peak of a simulated CUDA caching allocator replaying the allocations of meta tensors (no real compute)", "model": null, "name": "estimate", "note": null, "other_processes": null, "ram_total_bytes": null, "round_to": 1, "summary": "estimate for a CUDA GPU with 1.0 GiB, compute capability 8.0; 640.0 MiB allowed for the CUDA context and libraries; CUDA''s caching allocator simulated (PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF unset)", "torch": "2.13.0+cpu", "total_bytes": 1073741824}, "estimate_error": null, "estimated": true, "fingerprint": "b20792745014d76fd695a6dc1408a3c26e4f2dfdc3ae06afd201a6122956c9c5", "fragmentation_bytes": 5574144, "from_store": false, "headroom_bytes": 335124889, "kind": "autotune.ProbeResult", "limited_by": "max_batch", "margin": 0.1, "max_batch": 512, "max_micro_batch": 512, "notes": ["estimated with fake tensors, not confirmed on a real device", "cuBLAS workspaces held: 2 x 8.12 MiB (one per handle and stream: the forward''s thread and autograd''s backward thread each have a handle)", "cuBLASLt workspaces held: 1 x 1 MiB (one per handle and stream: the forward''s thread and autograd''s backward thread each have a handle)"], "options": {}, "parallel": "ddp", "peak_bytes": 27262976, "predicted_allocated_peak_bytes": 21688832, "predicted_peak_bytes": 27262976, "ranks": [], "real_ooms": 0, "real_runs": 0, "schema_version": 2, "seconds": 0.06785010099974897, "source": null, "trials": [{"allocated_bytes": 19794944, "batch": 2, "fits": true, "oom": false, "peak_bytes": 25165824, "retries": 0, "seconds": 0.023654223999983515, "source": "estimate", "why": null}, {"allocated_bytes": 19794944, "batch": 3, "fits": true, "oom": false, "peak_bytes": 25165824, "retries": 0, "seconds": 0.016563264999604144, "source": "estimate", "why": null}, {"allocated_bytes": 21688832, "batch": 512, "fits": true, "oom": false, "peak_bytes": 27262976, "retries": 0, "seconds": 0.02427441899999394, "source": "estimate", "why": null}], "usable_bytes": 362387865, "workload": "mlp", "world_size": null}', '0.1.0');
INSERT INTO public.autotune_entries VALUES ('b74b3f97479c13df645d3531910f336e5481829913f5f82f2ea2e567b157ae57', 'mlp', 'cpu (x86_64)', 'cpu', false, 307, 1021, 'memory', 1796338517.4852805, 0, NULL, NULL, NULL, '{"alloc_conf": "", "autotune": "0.1.0", "batch": {"2": {"leaves": [{"dtype": "torch.float32", "tensor": [2, 64]}, {"dtype": "torch.int64", "tensor": [2]}], "structure": "TreeSpec(tuple, None, [*, *])"}, "3": {"leaves": [{"dtype": "torch.float32", "tensor": [3, 64]}, {"dtype": "torch.int64", "tensor": [3]}], "structure": "TreeSpec(tuple, None, [*, *])"}}, "device": {"allowance_bytes": null, "budget_bytes": 3000000, "capacity_bytes": 3000000, "compute_capability": null, "cpu_count": 2, "cuda_like": null, "driver": null, "engine": null, "estimated": false, "kind": "cpu", "measured_by": "live tensor-storage bytes (autotune tracker)", "model": "x86_64", "name": "cpu", "ram_total_bytes": 25276071936, "round_to": null, "total_bytes": null}, "fit_rule": {"holds": {"loss_sum": true, "noise_buffer": 257}, "micro_steps": 2, "optimizer_steps": 2}, "margin": 0.1, "model": {"buffers": 0, "class": "torch.nn.modules.container.Sequential", "digest": "1d6aa2eeb3bd22018f9901d9e9cc2b8fd4aebf832d838dbe3e17d7fa4065d11a", "dtypes": ["torch.float32"], "modules": 6, "parameter_bytes": 340008, "parameters": 85002}, "ops": {"count": 49, "digest": "4b392ab6f33164c372c25d495829e6a506c2d06554c4f98731f502ab4699c69b", "engine": "meta", "traced": true}, "optimizer": {"class": "torch.optim.adamw.AdamW", "defaults": {"amsgrad": false, "betas": [0.9, 0.999], "capturable": false, "decoupled_weight_decay": true, "differentiable": false, "eps": 1e-08, "foreach": null, "fused": null, "lr": 0.001, "maximize": false, "weight_decay": 0.01}, "param_groups": [{"amsgrad": false, "betas": [0.9, 0.999], "capturable": false, "decoupled_weight_decay": true, "differentiable": false, "eps": 1e-08, "foreach": null, "fused": null, "lr": 0.001, "maximize": false, "numel": 85002, "params": 6, "weight_decay": 0.01}]}, "parallel": "ddp", "precision": "fp32", "rule": {"data_parallel": false}, "torch": "2.13.0+cpu", "workload": {"name": "mlp", "options": {}}, "world_size": 1}', '{"alloc_retries": null, "allocated_peak_bytes": null, "breakdown": {"activations": 1339588, "gradients": 340008, "optimizer_state": 680040, "parameters": 340008}, "capacity_bytes": 3000000, "curve": [[1, 1886420], [2, 1886420], [3, 1886420], [11, 1886420], [21, 1886420], [30, 1886420], [40, 1886420], [50, 1886420], [60, 1886420], [69, 1886420], [79, 1887836], [89, 1921196], [99, 1954556], [108, 1984580], [118, 2017940], [128, 2051300], [138, 2084660], [147, 2114684], [157, 2148044], [167, 2181404], [177, 2214764], [187, 2248124], [196, 2278148], [206, 2311508], [216, 2344868], [226, 2378228], [235, 2408252], [245, 2441612], [255, 2474972], [265, 2516524], [274, 2555764], [284, 2599364], [294, 2642964], [304, 2686564], [314, 2730164], [323, 2769404], [333, 2813004], [343, 2856604], [353, 2900204], [362, 2939444], [372, 2983044], [382, 3026644], [392, 3070244], [401, 3109484], [411, 3153084], [421, 3196684], [431, 3240284], [440, 3279524], [450, 3323124], [460, 3366724]], "curve_lines": [[1886420.0, 0.0], [1625300.0, 0.0], [1624292.0, 3336.0], [1623268.0, 3336.0], [1371404.0, 3376.0], [1371364.0, 3376.0], [1361124.0, 4360.0], [1031396.0, 4360.0], [681084.0, 4360.0], [351356.0, 4360.0]], "data_parallel": false, "device": {"allocator_conf": null, "allocator_conf_variable": null, "allowance_bytes": null, "budget_bytes": 3000000, "capacity_bytes": 3000000, "capacity_source": "memory budget", "compute_capability": null, "cpu_count": 2, "cuda_like": null, "driver": null, "engine": null, "engine_fallback": null, "estimated": false, "free_bytes": null, "kind": "cpu", "measured_by": "live tensor-storage bytes (autotune tracker)", "model": "x86_64", "name": "cpu", "note": null, "other_processes": null, "ram_total_bytes": 25276071936, "round_to": null, "summary": "cpu, capacity 2.9 MiB (memory budget)", "torch": "2.13.0+cpu", "total_bytes": null}, "estimate_error": 0.0, "estimated": false, "fingerprint": "b74b3f97479c13df645d3531910f336e5481829913f5f82f2ea2e567b157ae57", "fragmentation_bytes": null, "from_store": false, "headroom_bytes": 356, "kind": "autotune.ProbeResult", "limited_by": "memory", "margin": 0.1, "max_batch": 1021, "max_micro_batch": 307, "notes": [], "options": {}, "parallel": "ddp", "peak_bytes": 2699644, "predicted_allocated_peak_bytes": null, "predicted_peak_bytes": 2699644, "ranks": [], "real_ooms": 0, "real_runs": 1, "schema_version": 2, "seconds": 1.2275699390002046, "source": null, "trials": [{"allocated_bytes": null, "batch": 2, "fits": true, "oom": false, "peak_bytes": 1886420, "retries": null, "seconds": 0.045620748000146705, "source": "estimate", "why": null}, {"allocated_bytes": null, "batch": 3, "fits": true, "oom": false, "peak_bytes": 1886420, "retries": null, "seconds": 0.020535046000077273, "source": "estimate", "why": null}, {"allocated_bytes": null, "batch": 307, "fits": true, "oom": false, "peak_bytes": 2699644, "retries": null, "seconds": 1.1524812520001433, "source": "real", "why": null}], "usable_bytes": 2700000, "workload": "mlp", "world_size": null}', '0.1.0');
INSERT INTO public.autotune_entries VALUES ('d79703e28a73de1e78f85534e9053aa1ec3701383579bafdb48aba80f0319a5b', 'mlp', 'estimate for a CUDA GPU with 1.0 GiB, compute capability 8.0', 'estimate', true, 96, 96, 'max_batch', 1796338518.2040005, 0, NULL, 1796338518.2152672, 'a confirm run disagreed (planted for the test)', '{"alloc_conf": "", "autotune": "0.1.0", "batch": {"2": {"leaves": [{"dtype": "torch.float32", "tensor": [2, 64]}, {"dtype": "torch.int64", "tensor": [2]}], "structure": "TreeSpec(tuple, None, [*, *])"}, "3": {"leaves": [{"dtype": "torch.float32", "tensor": [3, 64]}, {"dtype": "torch.int64", "tensor": [3]}], "structure": "TreeSpec(tuple, None, [*, *])"}}, "device": {"allowance_bytes": 671088640, "budget_bytes": 1073741824, "capacity_bytes": 402653184, "compute_capability": "8.0", "cpu_count": null, "cuda_like": true, "driver": null, "engine": "meta", "estimated": true, "kind": "estimate", "measured_by": "reserved peak of a simulated CUDA caching allocator replaying the allocations of meta tensors (no real compute)", "model": null, "name": "estimate", "ram_total_bytes": null, "round_to": 1, "total_bytes": 1073741824}, "fit_rule": {"holds": {"loss_sum": true, "noise_buffer": 257}, "micro_steps": 2, "optimizer_steps": 2}, "margin": 0.3, "model": {"buffers": 0, "class": "torch.nn.modules.container.Sequential", "digest": "1d6aa2eeb3bd22018f9901d9e9cc2b8fd4aebf832d838dbe3e17d7fa4065d11a", "dtypes": ["torch.float32"], "modules": 6, "parameter_bytes": 340008, "parameters": 85002}, "ops": {"count": 49, "digest": "4b392ab6f33164c372c25d495829e6a506c2d06554c4f98731f502ab4699c69b", "engine": "meta", "traced": true}, "optimizer": {"class": "torch.optim.adamw.AdamW", "defaults": {"amsgrad": false, "betas": [0.9, 0.999], "capturable": false, "decoupled_weight_decay": true, "differentiable": false, "eps": 1e-08, "foreach": null, "fused": null, "lr": 0.001, "maximize": false, "weight_decay": 0.01}, "param_groups": [{"amsgrad": false, "betas": [0.9, 0.999], "capturable": false, "decoupled_weight_decay": true, "differentiable": false, "eps": 1e-08, "foreach": true, "fused": null, "lr": 0.001, "maximize": false, "numel": 85002, "params": 6, "weight_decay": 0.01}]}, "parallel": "ddp", "precision": "fp32", "rule": {"data_parallel": false}, "torch": "2.13.0+cpu", "workload": {"name": "mlp", "options": {}}, "world_size": 1}', '{"alloc_retries": 0, "allocated_peak_bytes": 20040192, "breakdown": {"activations": 584492, "gradients": 340008, "optimizer_state": 680040, "parameters": 340008}, "capacity_bytes": 402653184, "curve": [[1, 25165824], [2, 25165824], [3, 25165824], [4, 25165824], [7, 25165824], [10, 25165824], [13, 25165824], [16, 25165824], [19, 25165824], [22, 25165824], [25, 25172400], [28, 25182408], [31, 25192416], [34, 25202424], [38, 25215768], [41, 25225776], [44, 25235784], [47, 25245792], [50, 25012368], [53, 25022376], [56, 25032384], [59, 25042392], [62, 25052400], [65, 25062408], [68, 25072416], [71, 25082424], [74, 25092432], [77, 25102440], [80, 25112448], [83, 25122456], [86, 25132464], [89, 25142472], [92, 25152480], [95, 25162488], [96, 25165824], [98, 25172496], [101, 25182504], [104, 25192512], [107, 25202520], [111, 25215864], [114, 25225872], [117, 25235880], [120, 25245888], [123, 25255896], [126, 25265904], [129, 25275912], [132, 25285920], [135, 25295928], [138, 25305936], [141, 25315944], [144, 25325952]], "curve_lines": [[24922392.0, 0.0], [24922352.0, 0.0], [24912112.0, 0.0], [24911088.0, 0.0], [24845568.0, 3336.0], [24844544.0, 3336.0], [24592680.0, 3376.0], [24592640.0, 3376.0], [24582400.0, 4360.0], [24252672.0, 4360.0], [23902360.0, 4360.0], [23572632.0, 4360.0]], "data_parallel": false, "device": {"allocator_conf": "", "allocator_conf_variable": null, "allowance_bytes": 671088640, "budget_bytes": 1073741824, "capacity_bytes": 402653184, "capacity_source": "memory budget less the CUDA context allowance", "compute_capability": "8.0", "cpu_count": null, "cuda_like": true, "driver": null, "engine": "meta", "engine_fallback": null, "estimated": true, "free_bytes": null, "kind": "estimate", "measured_by": "reserved peak of a simulated CUDA caching allocator replaying the allocations of meta tensors (no real compute)", "model": null, "name": "estimate", "note": null, "other_processes": null, "ram_total_bytes": null, "round_to": 1, "summary": "estimate for a CUDA GPU with 1.0 GiB, compute capability 8.0; 640.0 MiB allowed for the CUDA context and libraries; CUDA''s caching allocator simulated (PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF unset)", "torch": "2.13.0+cpu", "total_bytes": 1073741824}, "estimate_error": null, "estimated": true, "fingerprint": "d79703e28a73de1e78f85534e9053aa1ec3701383579bafdb48aba80f0319a5b", "fragmentation_bytes": 5125632, "from_store": false, "headroom_bytes": 256691404, "kind": "autotune.ProbeResult", "limited_by": "max_batch", "margin": 0.3, "max_batch": 96, "max_micro_batch": 96, "notes": ["estimated with fake tensors, not confirmed on a real device", "cuBLAS workspaces held: 2 x 8.12 MiB (one per handle and stream: the forward''s thread and autograd''s backward thread each have a handle)", "cuBLASLt workspaces held: 1 x 1 MiB (one per handle and stream: the forward''s thread and autograd''s backward thread each have a handle)"], "options": {}, "parallel": "ddp", "peak_bytes": 25165824, "predicted_allocated_peak_bytes": 20040192, "predicted_peak_bytes": 25165824, "ranks": [], "real_ooms": 0, "real_runs": 0, "schema_version": 2, "seconds": 0.10338065500036464, "source": null, "trials": [{"allocated_bytes": 19794944, "batch": 2, "fits": true, "oom": false, "peak_bytes": 25165824, "retries": 0, "seconds": 0.03826517600009538, "source": "estimate", "why": null}, {"allocated_bytes": 19794944, "batch": 3, "fits": true, "oom": false, "peak_bytes": 25165824, "retries": 0, "seconds": 0.030406211999434163, "source": "estimate", "why": null}, {"allocated_bytes": 20040192, "batch": 96, "fits": true, "oom": false, "peak_bytes": 25165824, "retries": 0, "seconds": 0.01907386899983976, "source": "estimate", "why": null}], "usable_bytes": 281857228, "workload": "mlp", "world_size": null}', '0.1.0');


--
-- Data for Name: autotune_measurements; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.autotune_measurements VALUES (1, 'b74b3f97479c13df645d3531910f336e5481829913f5f82f2ea2e567b157ae57', 1796338517.4984207, 'probe', 'cpu (x86_64)', 'cpu', 307, 2699644, 2699644, 2699644, false, 0, NULL, 1.1524812520001433, NULL);
INSERT INTO public.autotune_measurements VALUES (2, 'b74b3f97479c13df645d3531910f336e5481829913f5f82f2ea2e567b157ae57', 1796338518.0250533, 'run', 'cpu (x86_64)', 'cpu', 256, 2478308, 2478308, 2478308, false, 0, 8862.165866312485, 0.49519474299995636, NULL);
INSERT INTO public.autotune_measurements VALUES (3, 'b20792745014d76fd695a6dc1408a3c26e4f2dfdc3ae06afd201a6122956c9c5', 1796338518.2161536, 'reported', 'NVIDIA H100 80GB HBM3', 'cuda', 64, 2000000, 1800000, NULL, false, 0, 5000, NULL, NULL);


--
-- Data for Name: autotune_plans; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.autotune_plans VALUES (1, 'b20792745014d76fd695a6dc1408a3c26e4f2dfdc3ae06afd201a6122956c9c5', '512/1/1/True', 512, 1, 1796338516.1982358, '{"accumulation_steps": 1, "arithmetic": "512 = 512 x 1 step x 1 rank", "headroom_bytes": 335124889, "kind": "autotune.Plan", "max_micro_batch": 512, "micro_batch": 512, "multiple_of": 1, "notes": ["from the store (fingerprint b20792745014, measured 2026-12-03 22:55 UTC on estimate for a CUDA GPU with 1.0 GiB, compute capability 8.0)"], "parallel": "ddp", "per_rank_batch": [512], "predicted_peak_bytes": 27262976, "probe": {"alloc_retries": 0, "allocated_peak_bytes": 21688832, "breakdown": {"activations": 2233388, "gradients": 340008, "optimizer_state": 680040, "parameters": 340008}, "capacity_bytes": 402653184, "curve": [[1, 25165824], [2, 25165824], [3, 25165824], [17, 25165824], [34, 25202424], [50, 25255800], [66, 25309176], [83, 25365888], [99, 25419264], [115, 25472640], [132, 25529352], [148, 25582728], [164, 25636104], [181, 25692816], [197, 25746192], [213, 25799568], [229, 25852944], [246, 25909656], [262, 26172976], [278, 26242736], [295, 26316856], [311, 26386616], [327, 26456376], [344, 26530496], [360, 26600256], [376, 26670016], [393, 26744136], [409, 26813896], [425, 26883656], [442, 26957776], [458, 27027536], [474, 27097296], [491, 27171416], [507, 27241176], [512, 27262976], [523, 27310936], [540, 27385056], [556, 27454816], [572, 27524576], [588, 27594336], [605, 27668456], [621, 27738216], [637, 27807976], [654, 27882096], [670, 27951856], [686, 28021616], [703, 28095736], [719, 28165496], [735, 28235256], [752, 28309376], [768, 28379136]], "curve_lines": [[25370648.0, 0.0], [25370608.0, 0.0], [25360368.0, 0.0], [25359344.0, 0.0], [25293824.0, 3336.0], [25292800.0, 3336.0], [25040936.0, 3376.0], [25040896.0, 3376.0], [25030656.0, 4360.0], [24700928.0, 4360.0], [24350616.0, 4360.0], [24020888.0, 4360.0]], "data_parallel": false, "device": {"allocator_conf": "", "allocator_conf_variable": null, "allowance_bytes": 671088640, "budget_bytes": 1073741824, "capacity_bytes": 402653184, "capacity_source": "memory budget less the CUDA context allowance", "compute_capability": "8.0", "cpu_count": null, "cuda_like": true, "driver": null, "engine": "meta", "engine_fallback": null, "estimated": true, "free_bytes": null, "kind": "estimate", "measured_by": "reserved peak of a simulated CUDA caching allocator replaying the allocations of meta tensors (no real compute)", "model": null, "name": "estimate", "note": null, "other_processes": null, "ram_total_bytes": null, "round_to": 1, "summary": "estimate for a CUDA GPU with 1.0 GiB, compute capability 8.0; 640.0 MiB allowed for the CUDA context and libraries; CUDA''s caching allocator simulated (PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF unset)", "torch": "2.13.0+cpu", "total_bytes": 1073741824}, "estimate_error": null, "estimated": true, "fingerprint": "b20792745014d76fd695a6dc1408a3c26e4f2dfdc3ae06afd201a6122956c9c5", "fragmentation_bytes": 5574144, "from_store": true, "headroom_bytes": 335124889, "kind": "autotune.ProbeResult", "limited_by": "max_batch", "margin": 0.1, "max_batch": 512, "max_micro_batch": 512, "notes": ["from the store (fingerprint b20792745014, measured 2026-12-03 22:55 UTC on estimate for a CUDA GPU with 1.0 GiB, compute capability 8.0)", "estimated with fake tensors, not confirmed on a real device", "cuBLAS workspaces held: 2 x 8.12 MiB (one per handle and stream: the forward''s thread and autograd''s backward thread each have a handle)", "cuBLASLt workspaces held: 1 x 1 MiB (one per handle and stream: the forward''s thread and autograd''s backward thread each have a handle)"], "options": {}, "parallel": "ddp", "peak_bytes": 27262976, "predicted_allocated_peak_bytes": 21688832, "predicted_peak_bytes": 27262976, "ranks": [], "real_ooms": 0, "real_runs": 0, "schema_version": 2, "seconds": 0.0016207540002142196, "source": "mlp", "trials": [{"allocated_bytes": 19794944, "batch": 2, "fits": true, "oom": false, "peak_bytes": 25165824, "retries": 0, "seconds": 0.023654223999983515, "source": "estimate", "why": null}, {"allocated_bytes": 19794944, "batch": 3, "fits": true, "oom": false, "peak_bytes": 25165824, "retries": 0, "seconds": 0.016563264999604144, "source": "estimate", "why": null}, {"allocated_bytes": 21688832, "batch": 512, "fits": true, "oom": false, "peak_bytes": 27262976, "retries": 0, "seconds": 0.02427441899999394, "source": "estimate", "why": null}], "usable_bytes": 362387865, "workload": "mlp", "world_size": null}, "schedule": [[512]], "schema_version": 2, "target_batch": 512, "tuning": null, "uniform": true, "world_size": 1, "world_size_source": "default"}');
INSERT INTO public.autotune_plans VALUES (2, 'b74b3f97479c13df645d3531910f336e5481829913f5f82f2ea2e567b157ae57', '1021/1/1/False', 1021, 1, 1796338517.5007958, '{"accumulation_steps": 4, "arithmetic": "1021 = 3 x 255 + 1 x 256 over 4 steps x 1 rank", "headroom_bytes": 221692, "kind": "autotune.Plan", "max_micro_batch": 307, "micro_batch": 256, "multiple_of": 1, "notes": ["uneven micro-batches: autotune''s runner weights each loss by n_i / N, so the gradient equals the full-batch one; frameworks that assume equal micro-batches would not"], "parallel": "ddp", "per_rank_batch": [1021], "predicted_peak_bytes": 2478308, "probe": {"alloc_retries": null, "allocated_peak_bytes": null, "breakdown": {"activations": 1339588, "gradients": 340008, "optimizer_state": 680040, "parameters": 340008}, "capacity_bytes": 3000000, "curve": [[1, 1886420], [2, 1886420], [3, 1886420], [11, 1886420], [21, 1886420], [30, 1886420], [40, 1886420], [50, 1886420], [60, 1886420], [69, 1886420], [79, 1887836], [89, 1921196], [99, 1954556], [108, 1984580], [118, 2017940], [128, 2051300], [138, 2084660], [147, 2114684], [157, 2148044], [167, 2181404], [177, 2214764], [187, 2248124], [196, 2278148], [206, 2311508], [216, 2344868], [226, 2378228], [235, 2408252], [245, 2441612], [255, 2474972], [265, 2516524], [274, 2555764], [284, 2599364], [294, 2642964], [304, 2686564], [314, 2730164], [323, 2769404], [333, 2813004], [343, 2856604], [353, 2900204], [362, 2939444], [372, 2983044], [382, 3026644], [392, 3070244], [401, 3109484], [411, 3153084], [421, 3196684], [431, 3240284], [440, 3279524], [450, 3323124], [460, 3366724]], "curve_lines": [[1886420.0, 0.0], [1625300.0, 0.0], [1624292.0, 3336.0], [1623268.0, 3336.0], [1371404.0, 3376.0], [1371364.0, 3376.0], [1361124.0, 4360.0], [1031396.0, 4360.0], [681084.0, 4360.0], [351356.0, 4360.0]], "data_parallel": false, "device": {"allocator_conf": null, "allocator_conf_variable": null, "allowance_bytes": null, "budget_bytes": 3000000, "capacity_bytes": 3000000, "capacity_source": "memory budget", "compute_capability": null, "cpu_count": 2, "cuda_like": null, "driver": null, "engine": null, "engine_fallback": null, "estimated": false, "free_bytes": null, "kind": "cpu", "measured_by": "live tensor-storage bytes (autotune tracker)", "model": "x86_64", "name": "cpu", "note": null, "other_processes": null, "ram_total_bytes": 25276071936, "round_to": null, "summary": "cpu, capacity 2.9 MiB (memory budget)", "torch": "2.13.0+cpu", "total_bytes": null}, "estimate_error": 0.0, "estimated": false, "fingerprint": "b74b3f97479c13df645d3531910f336e5481829913f5f82f2ea2e567b157ae57", "fragmentation_bytes": null, "from_store": false, "headroom_bytes": 356, "kind": "autotune.ProbeResult", "limited_by": "memory", "margin": 0.1, "max_batch": 1021, "max_micro_batch": 307, "notes": [], "options": {}, "parallel": "ddp", "peak_bytes": 2699644, "predicted_allocated_peak_bytes": null, "predicted_peak_bytes": 2699644, "ranks": [], "real_ooms": 0, "real_runs": 1, "schema_version": 2, "seconds": 1.2275699390002046, "source": "mlp", "trials": [{"allocated_bytes": null, "batch": 2, "fits": true, "oom": false, "peak_bytes": 1886420, "retries": null, "seconds": 0.045620748000146705, "source": "estimate", "why": null}, {"allocated_bytes": null, "batch": 3, "fits": true, "oom": false, "peak_bytes": 1886420, "retries": null, "seconds": 0.020535046000077273, "source": "estimate", "why": null}, {"allocated_bytes": null, "batch": 307, "fits": true, "oom": false, "peak_bytes": 2699644, "retries": null, "seconds": 1.1524812520001433, "source": "real", "why": null}], "usable_bytes": 2700000, "workload": "mlp", "world_size": null}, "schedule": [[255, 255, 255, 256]], "schema_version": 2, "target_batch": 1021, "tuning": null, "uniform": false, "world_size": 1, "world_size_source": "default"}');
INSERT INTO public.autotune_plans VALUES (3, 'd79703e28a73de1e78f85534e9053aa1ec3701383579bafdb48aba80f0319a5b', '96/1/1/True', 96, 1, 1796338518.212888, '{"accumulation_steps": 1, "arithmetic": "96 = 96 x 1 step x 1 rank", "headroom_bytes": 256691404, "kind": "autotune.Plan", "max_micro_batch": 96, "micro_batch": 96, "multiple_of": 1, "notes": [], "parallel": "ddp", "per_rank_batch": [96], "predicted_peak_bytes": 25165824, "probe": {"alloc_retries": 0, "allocated_peak_bytes": 20040192, "breakdown": {"activations": 584492, "gradients": 340008, "optimizer_state": 680040, "parameters": 340008}, "capacity_bytes": 402653184, "curve": [[1, 25165824], [2, 25165824], [3, 25165824], [4, 25165824], [7, 25165824], [10, 25165824], [13, 25165824], [16, 25165824], [19, 25165824], [22, 25165824], [25, 25172400], [28, 25182408], [31, 25192416], [34, 25202424], [38, 25215768], [41, 25225776], [44, 25235784], [47, 25245792], [50, 25012368], [53, 25022376], [56, 25032384], [59, 25042392], [62, 25052400], [65, 25062408], [68, 25072416], [71, 25082424], [74, 25092432], [77, 25102440], [80, 25112448], [83, 25122456], [86, 25132464], [89, 25142472], [92, 25152480], [95, 25162488], [96, 25165824], [98, 25172496], [101, 25182504], [104, 25192512], [107, 25202520], [111, 25215864], [114, 25225872], [117, 25235880], [120, 25245888], [123, 25255896], [126, 25265904], [129, 25275912], [132, 25285920], [135, 25295928], [138, 25305936], [141, 25315944], [144, 25325952]], "curve_lines": [[24922392.0, 0.0], [24922352.0, 0.0], [24912112.0, 0.0], [24911088.0, 0.0], [24845568.0, 3336.0], [24844544.0, 3336.0], [24592680.0, 3376.0], [24592640.0, 3376.0], [24582400.0, 4360.0], [24252672.0, 4360.0], [23902360.0, 4360.0], [23572632.0, 4360.0]], "data_parallel": false, "device": {"allocator_conf": "", "allocator_conf_variable": null, "allowance_bytes": 671088640, "budget_bytes": 1073741824, "capacity_bytes": 402653184, "capacity_source": "memory budget less the CUDA context allowance", "compute_capability": "8.0", "cpu_count": null, "cuda_like": true, "driver": null, "engine": "meta", "engine_fallback": null, "estimated": true, "free_bytes": null, "kind": "estimate", "measured_by": "reserved peak of a simulated CUDA caching allocator replaying the allocations of meta tensors (no real compute)", "model": null, "name": "estimate", "note": null, "other_processes": null, "ram_total_bytes": null, "round_to": 1, "summary": "estimate for a CUDA GPU with 1.0 GiB, compute capability 8.0; 640.0 MiB allowed for the CUDA context and libraries; CUDA''s caching allocator simulated (PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF unset)", "torch": "2.13.0+cpu", "total_bytes": 1073741824}, "estimate_error": null, "estimated": true, "fingerprint": "d79703e28a73de1e78f85534e9053aa1ec3701383579bafdb48aba80f0319a5b", "fragmentation_bytes": 5125632, "from_store": false, "headroom_bytes": 256691404, "kind": "autotune.ProbeResult", "limited_by": "max_batch", "margin": 0.3, "max_batch": 96, "max_micro_batch": 96, "notes": ["estimated with fake tensors, not confirmed on a real device", "cuBLAS workspaces held: 2 x 8.12 MiB (one per handle and stream: the forward''s thread and autograd''s backward thread each have a handle)", "cuBLASLt workspaces held: 1 x 1 MiB (one per handle and stream: the forward''s thread and autograd''s backward thread each have a handle)"], "options": {}, "parallel": "ddp", "peak_bytes": 25165824, "predicted_allocated_peak_bytes": 20040192, "predicted_peak_bytes": 25165824, "ranks": [], "real_ooms": 0, "real_runs": 0, "schema_version": 2, "seconds": 0.10338065500036464, "source": "mlp", "trials": [{"allocated_bytes": 19794944, "batch": 2, "fits": true, "oom": false, "peak_bytes": 25165824, "retries": 0, "seconds": 0.03826517600009538, "source": "estimate", "why": null}, {"allocated_bytes": 19794944, "batch": 3, "fits": true, "oom": false, "peak_bytes": 25165824, "retries": 0, "seconds": 0.030406211999434163, "source": "estimate", "why": null}, {"allocated_bytes": 20040192, "batch": 96, "fits": true, "oom": false, "peak_bytes": 25165824, "retries": 0, "seconds": 0.01907386899983976, "source": "estimate", "why": null}], "usable_bytes": 281857228, "workload": "mlp", "world_size": null}, "schedule": [[96]], "schema_version": 2, "target_batch": 96, "tuning": null, "uniform": true, "world_size": 1, "world_size_source": "default"}');


--
-- Data for Name: autotune_store_info; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.autotune_store_info VALUES ('schema', '1');


--
-- Name: autotune_measurements_id_seq; Type: SEQUENCE SET; Schema: public; Owner: -
--

SELECT pg_catalog.setval('public.autotune_measurements_id_seq', 3, true);


--
-- Name: autotune_plans_id_seq; Type: SEQUENCE SET; Schema: public; Owner: -
--

SELECT pg_catalog.setval('public.autotune_plans_id_seq', 3, true);


--
-- Name: autotune_claims autotune_claims_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.autotune_claims
    ADD CONSTRAINT autotune_claims_pkey PRIMARY KEY (fingerprint);


--
-- Name: autotune_entries autotune_entries_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.autotune_entries
    ADD CONSTRAINT autotune_entries_pkey PRIMARY KEY (fingerprint);


--
-- Name: autotune_measurements autotune_measurements_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.autotune_measurements
    ADD CONSTRAINT autotune_measurements_pkey PRIMARY KEY (id);


--
-- Name: autotune_plans autotune_plans_fingerprint_key; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.autotune_plans
    ADD CONSTRAINT autotune_plans_fingerprint_key UNIQUE (fingerprint, key);


--
-- Name: autotune_plans autotune_plans_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.autotune_plans
    ADD CONSTRAINT autotune_plans_pkey PRIMARY KEY (id);


--
-- Name: autotune_store_info autotune_store_info_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.autotune_store_info
    ADD CONSTRAINT autotune_store_info_pkey PRIMARY KEY (key);


--
-- Name: autotune_measurements_fingerprint; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX autotune_measurements_fingerprint ON public.autotune_measurements USING btree (fingerprint);


--
-- PostgreSQL database dump complete
--

\unrestrict LhBKHs6guxB0QHa4yfnkfDGkHyjRaOm1qxBo4YOjhjsmhCajo5ve6ZZfVgi1AoD

