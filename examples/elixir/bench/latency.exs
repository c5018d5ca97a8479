# Forward attention latency from Elixir, for a game loop: µs per call at B = 1, D = 64,
# S = 16..128, H = 4, 8, f32 and bf16, kernels inline on one core (threads: 1), against the
# same kernel called from C on the same arguments (FlashGen.NIF.time_in_c: no terms, no
# allocation, no scheduling). Rounds interleave the three ways of calling; each call is timed
# alone (monotonic ns); medians, p99 and means over all calls of all rounds. Usage:
#   FLASHGEN_NIF_LIBRARY=priv/flashgen mix run bench/latency.exs [OUT.json] [--calls N] [--rounds R]
alias FlashGen.{Attention, NIF}

{switches, args, _} = OptionParser.parse(System.argv(), strict: [calls: :integer, rounds: :integer])
calls = Keyword.get(switches, :calls, 300)
rounds = Keyword.get(switches, :rounds, 5)
:ok = NIF.load(System.fetch_env!("FLASHGEN_NIF_LIBRARY"))

normal = fn n, type ->
  for _ <- 1..n, into: <<>> do
    case type do
      :f32 -> <<:rand.normal()::float-32-native>>
      :bf16 -> (<<hi::16, _::16>> = <<:rand.normal()::float-32-big>>; <<hi::16-native>>)
    end
  end
end

median = fn xs -> xs |> Enum.sort() |> Enum.at(div(length(xs), 2)) end
p99 = fn xs -> xs |> Enum.sort() |> Enum.at(min(length(xs) - 1, trunc(length(xs) * 0.99))) end

# per-call nanoseconds of `f` over `calls` calls
per_call = fn f ->
  for _ <- 1..calls do
    t0 = :erlang.monotonic_time(:nanosecond)
    {:ok, _} = f.()
    :erlang.monotonic_time(:nanosecond) - t0
  end
end

rows =
  for type <- [:f32, :bf16], h <- [4, 8], s <- [16, 32, 64, 128] do
    shape = {1, s, h, 64}
    [q, k, v] = for _ <- 1..3, do: {normal.(s * h * 64, type), shape}
    opts = [type: type]
    target = FlashGen.Attention.Target.name(:fwd, 64, if(type == :f32, do: {:f, 32}, else: {:bf, 16}), false)
    nif_args = for {data, sh} <- [q, k, v], do: {type, sh, data}
    results = [{type, shape}, {:f32, {1, h, s}}]
    attrs = Attention.attributes(opts, 64, [])
    api = fn -> Attention.attention(q, k, v, opts) end
    raw = fn -> NIF.call(target, nif_args, results, attrs) end
    in_c = fn -> NIF.time_in_c(target, nif_args, results, attrs, calls) end
    for _ <- 1..20, do: {api.(), raw.()}

    samples =
      Enum.reduce(1..rounds, %{api: [], nif: [], c: []}, fn round, acc ->
        order = if rem(round, 2) == 0, do: [:c, :nif, :api], else: [:api, :nif, :c]

        Enum.reduce(order, acc, fn
          :api, acc -> %{acc | api: acc.api ++ per_call.(api)}
          :nif, acc -> %{acc | nif: acc.nif ++ per_call.(raw)}
          :c, acc -> (({:ok, ns} = in_c.()); %{acc | c: acc.c ++ ns})
        end)
      end)

    [api_med, nif_med, c_med] = for k <- [:api, :nif, :c], do: median.(samples[k]) / 1000

    row = %{
      type: type, heads: h, seq: s,
      elixir_us: Float.round(api_med, 1), elixir_p99_us: Float.round(p99.(samples.api) / 1000, 1),
      elixir_mean_us: Float.round(Enum.sum(samples.api) / length(samples.api) / 1000, 1),
      nif_call_us: Float.round(nif_med, 1), c_us: Float.round(c_med, 1),
      boundary_us: Float.round(api_med - c_med, 1),
      boundary_share: Float.round((api_med - c_med) / api_med, 3),
      # where the call ran: a normal scheduler (small work) or a dirty CPU scheduler
      scheduler: if(s * s * h * 64 <= NIF.contract().inline_work, do: :normal, else: :dirty)
    }

    IO.puts(
      "#{type} H=#{h} S=#{s}: Elixir #{row.elixir_us} us (p99 #{row.elixir_p99_us}), NIF.call #{row.nif_call_us} us, " <>
        "C #{row.c_us} us, boundary #{Float.round(100 * row.boundary_share, 1)}%"
    )

    row
  end

{load1, _} = (case File.read("/proc/loadavg") do {:ok, t} -> Float.parse(t); _ -> {-1.0, ""} end)

json_value = fn
  x when is_atom(x) -> ~s("#{x}")
  x -> to_string(x)
end

json =
  "{\"calls_per_round\": #{calls}, \"rounds\": #{rounds}, \"load_average_1min_at_end\": #{load1}, " <>
    "\"schedulers\": #{:erlang.system_info(:schedulers_online)}, \"dirty_cpu_schedulers\": " <>
    "#{:erlang.system_info(:dirty_cpu_schedulers_online)}, \"otp\": \"#{:erlang.system_info(:otp_release)}\", " <>
    "\"elixir\": \"#{System.version()}\", \"rows\": [\n" <>
    Enum.map_join(rows, ",\n", fn r -> "  {" <> Enum.map_join(r, ", ", fn {k, v} -> ~s("#{k}": #{json_value.(v)}) end) <> "}" end) <>
    "\n]}\n"

case args do
  [out | _] -> File.write!(out, json)
  [] -> IO.write(json)
end
