# hit-rate.gp - draws tqkv-bench's --csv time series: the hit rate of each second (and
# cumulative) and the servers the client follows, e.g. through a rolling restart.
#   gnuplot -e "csv='bench.csv'; out='hit-rate.svg'; title='rolling restart'" deploy/bench/hit-rate.gp
# Variables: csv (input, default bench.csv), out (output; .png or .svg; default
# hit-rate.svg), title. gnuplot from Debian: apt-get install gnuplot-nox.
if (!exists("csv")) csv = "bench.csv"
if (!exists("out")) out = "hit-rate.svg"
if (!exists("title")) title = "tqkv-bench hit rate"
if (out[strlen(out)-3:] eq "png") {
    set terminal pngcairo size 1000,500 font ",10"
} else {
    set terminal svg size 1000,500 font ",10"
}
set output out
set datafile separator ","
set key autotitle columnhead bottom left
set title title
set xlabel "seconds"
set ylabel "hit rate (%)"
set yrange [0:105]
set y2label "servers followed"
set y2range [0:*]
set y2tics 1
set ytics nomirror
set grid
plot csv using 1:($9*100) with lines lw 2 title "hit rate (each second)", \
     csv using 1:($6*100) with lines dt 2 title "hit rate (cumulative)", \
     csv using 1:10 axes x1y2 with steps lw 1 title "servers"
